"""Helpers of the segment-compiler tests: run a reference stage compiled and eagerly, compare."""

from __future__ import annotations

from typing import Any

import torch
from stage_checks import assert_close

import ppcompile
from ppcompile.models import ModelConfig, PPStage, make_batch, make_forward_context, set_forward_context
from ppcompile.runtime.stage_runtime import StageRuntime


def run(stage: PPStage, fn: Any, cfg: ModelConfig, rank: int, pp: int, n: int) -> Any:
    """``fn`` (the stage or its compiled form) on a random ``n``-token batch for ``rank``."""
    ids, pos, proxies = make_batch(cfg, [n], rank, pp, seed=n)
    layers = range(stage.start_layer, stage.end_layer)
    kw = {"input_ids": ids} if rank == 0 else {"input_ids": None, "pp_proxy_tensors": proxies}
    with torch.inference_mode(), set_forward_context(make_forward_context([n], cfg, layers)):
        return fn(positions=pos, **kw)


def check(stage: PPStage, compiled: Any, cfg: ModelConfig, rank: int, pp: int, n: int) -> None:
    """The compiled stage equals the eager one at ``n`` tokens."""
    want = run(stage, stage, cfg, rank, pp, n)
    got = run(stage, compiled, cfg, rank, pp, n)
    assert_close(got, want, f"stage {rank} at {n} tokens")


def graphed_runtime(allow_graphless: bool = False) -> StageRuntime:
    """The newest runtime that serves forwards with graphs (not a static 1-token one); with
    ``allow_graphless``, also one compiled with ``graph_mode="none"``."""
    runtimes = [rt for rt in ppcompile.stage_runtimes()
                if rt.eager_reason is None or (allow_graphless and rt.graph_mode == "none")]
    assert runtimes, "no graphed stage runtime was built"
    return runtimes[-1]

"""A middle PP stage of the reference decoder, or an HF stage, compiled with ``pp_breakable`` and run next
to eager at several token counts: what the tests of ``trace_layers_once`` (regions and stamped layers)
compare."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from stage_checks import assert_close
from torch import nn

import ppcompile
from ppcompile.models import ModelConfig, make_batch, make_forward_context, set_forward_context
from ppcompile.runtime.stage_runtime import StageRuntime

__all__ = ["new_runtimes", "run_hf_stage", "run_middle_stage"]


def new_runtimes(before: list[StageRuntime]) -> list[StageRuntime]:
    """The stage runtimes with a token symbol made since ``before`` was taken."""
    return [rt for rt in ppcompile.stage_runtimes() if not any(rt is b for b in before)
            and rt.token_symbol is not None]


def run_middle_stage(
    stage: nn.Module, cfg: ModelConfig, options: Mapping[str, Any], counts: Sequence[int]
) -> tuple[list[Any], list[Any], StageRuntime]:
    """``stage`` (stage 1 of 3 of ``cfg``) compiled and eager at every count: (compiled outputs, eager
    outputs, the one runtime serving it). The first count marks the token dims dynamic."""
    before = ppcompile.stage_runtimes()
    compiled = torch.compile(stage, backend="pp_breakable", options=dict(options))
    got, want = [], []
    for n in counts:
        _, pos, proxies = make_batch(cfg, [n], 1, 3, seed=n)
        if n == counts[0]:
            ppcompile.mark_token_dynamic(pos, proxies)
        ctx = make_forward_context([n], cfg, range(stage.start_layer, stage.end_layer))
        with torch.inference_mode(), set_forward_context(ctx):  # outputs live until the next call: clone
            got.append({k: v.clone() for k, v in compiled(None, pos, pp_proxy_tensors=proxies).items()})
            want.append(dict(stage(None, pos, pp_proxy_tensors=proxies).items()))
    runtimes = new_runtimes(before)
    assert len(runtimes) == 1, [rt.label for rt in runtimes]
    return got, want, runtimes[0]


def run_hf_stage(stage: nn.Module, options: Mapping[str, Any], counts: Sequence[int],
                 label: str) -> list[StageRuntime]:
    """An ``HFStage`` (token ids and positions in, hidden states out) compiled and eager at every count,
    compared; the runtimes made for it. The first count marks the token dims dynamic."""
    before = ppcompile.stage_runtimes()
    compiled = torch.compile(stage, backend="pp_breakable", options=dict(options))
    for n in counts:
        ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n))
        positions = torch.arange(n)
        if n == counts[0]:
            ppcompile.mark_token_dynamic(ids, positions)
        with torch.inference_mode():
            assert_close(compiled(ids, positions).clone(), stage(ids, positions), f"{label} at {n}", 1e-4)
    return new_runtimes(before)

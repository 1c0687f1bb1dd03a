"""End to end: PP4 pipelines of the reference models under ``pp_breakable`` equal eager, stage by stage,
at 1 token, a bucket exactly, a bucket + 1, just under the cap and above it; the path each forward takes
is checked with ``ppcompile.counters``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from stage_checks import assert_close

import ppcompile
from ppcompile.models import (
    REFERENCE_CONFIGS,
    ModelConfig,
    make_batch,
    make_forward_context,
    make_stage,
    set_forward_context,
)
from ppcompile.pipeline import InProcessPipeline
from ppcompile.records import BreakKind

PP = 4
SIZES = [4, 8, 16, 32, 64]
CAP = SIZES[-1]
OPTIONS = {"capture_sizes": SIZES, "graph_mode": "emulate"}  # the graph path ("auto" is live-size on CPU)
# (seq_lens, bucket or None for eager): 1 token, a bucket exactly, bucket + 1, just under the cap, above it
CASES: list[tuple[list[int], int | None]] = [
    ([1], None),
    ([7, 9], 16),
    ([5, 12], 32),
    ([20, 20, 23], 64),
    ([30, 40], None),
]


pytestmark = pytest.mark.usefixtures("fresh_dynamo", "one_thread")


def stagewise(
    graphed: InProcessPipeline, eager: InProcessPipeline, lens: Sequence[int], seed: int = 0
) -> None:
    """Feeds every compiled stage the eager stage's inputs and compares each stage's output."""
    ids, pos, _ = make_batch(graphed.cfg, lens, 0, graphed.pp_size, seed=seed)
    proxies: Any = None
    for rank in range(graphed.pp_size):
        kw = {"input_ids": ids} if rank == 0 else {"pp_proxy_tensors": proxies}
        want = eager.run_stage(rank, pos, lens, **kw)
        got = graphed.run_stage(rank, pos, lens, **kw)
        assert_close(got, want, f"stage {rank}, {sum(lens)} tokens {list(lens)}")
        proxies = want


def expect_path(bucket: int | None, calls: int) -> Any:
    """``counters.expect`` for ``calls`` stage calls all served by ``bucket`` (None: eager)."""
    if bucket is None:
        return ppcompile.counters.expect(replays=0, eager_runs=calls, replays_by_bucket={})
    return ppcompile.counters.expect(replays=calls, eager_runs=0, replays_by_bucket={bucket: calls})


@pytest.mark.parametrize("cfg_name", ["small-dense", "small-moe", "hidden-only", "topk", "out-variant"])
def test_pp4_matches_eager_per_stage(cfg_name: str) -> None:
    cfg = REFERENCE_CONFIGS[cfg_name]
    eager = InProcessPipeline(cfg, PP, compiled=False)
    graphed = InProcessPipeline(cfg, PP, compiled=True, options=OPTIONS)
    for lens, bucket in CASES:
        with torch.inference_mode():
            with expect_path(bucket, PP):
                stagewise(graphed, eager, lens)
            ids, pos, _ = make_batch(cfg, lens, 0, PP, seed=1)
            want = eager(ids, pos, lens)
            with expect_path(bucket, PP):
                got = graphed(ids, pos, lens)
        assert_close(got, want, f"{cfg_name} logits at {sum(lens)} tokens")
        assert [t.path for t in graphed.traces if t] == ["eager" if bucket is None else "graph"] * PP


def test_out_variant_attention_needs_no_bridges() -> None:
    """Functional attention returns a fresh tensor that is copied into a bridge per layer; the
    out-variant op writes the graph's own memory, so its stages have no bridges at all."""
    bridges = {}
    for name in ("small-dense", "out-variant"):
        torch._dynamo.reset()
        graphed = InProcessPipeline(REFERENCE_CONFIGS[name], PP, compiled=True, options=OPTIONS)
        lens = [7, 9]
        ids, pos, _ = make_batch(graphed.cfg, lens, 0, PP)
        with torch.inference_mode(), expect_path(16, PP):
            graphed(ids, pos, lens)
        runtimes = [rt for rt in ppcompile.stage_runtimes() if rt.token_symbol is not None][-PP:]
        bridges[name] = sum(len(rt.program.bridge_buffers) for rt in runtimes)
        if name == "out-variant":
            in_place = sum(len(st.in_place) for rt in runtimes for st in rt.program.break_steps)
            assert in_place == REFERENCE_CONFIGS[name].num_layers
    assert bridges == {"small-dense": REFERENCE_CONFIGS["small-dense"].num_layers, "out-variant": 0}


def test_pp2_with_the_in_place_norm_matches_eager_with_every_norm_in_a_graph() -> None:
    """vLLM's layers write ``hidden`` and ``residual`` in place with ``fused_add_rms_norm``. On a later
    stage ``residual`` is the tensor the stage received: its norms write the residual's static buffer in
    the graphs, and the runtime copies it back into the received tensor at the end of the call. No norm
    is a break on either stage: each stage breaks at its attention ops only."""
    cfg = REFERENCE_CONFIGS["in-place-norm"].replace(num_layers=4)
    eager = InProcessPipeline(cfg, 2, compiled=False)
    graphed = InProcessPipeline(cfg, 2, compiled=True, options=OPTIONS)
    for lens, bucket in CASES:
        ids, pos, _ = make_batch(cfg, lens, 0, 2, seed=1)
        with torch.inference_mode(), expect_path(bucket, 2):
            got = graphed(ids, pos, lens)
        with torch.inference_mode():
            assert_close(got, eager(ids, pos, lens), f"in-place-norm logits at {sum(lens)} tokens")
    first, second = [rt for rt in ppcompile.stage_runtimes() if rt.token_symbol is not None][-2:]
    for rt in (first, second):
        assert [r.kind for r in rt.break_reasons] == [BreakKind.ATTENTION] * 2, rt.describe()
    # hidden and residual received
    assert sum(len(st.writes_buffers) for st in second.program.graph_steps) >= 2


def test_one_token_topk_stage_runs_eagerly() -> None:
    """With 1 token the token dim is specialised; the dynamic topk width must not pass for tokens."""
    cfg = REFERENCE_CONFIGS["topk"]
    stage = make_stage(cfg, 1, PP)
    compiled = torch.compile(stage, backend="pp_breakable", dynamic=True, options=OPTIONS)
    _, pos, proxies = make_batch(cfg, [1], 1, PP)
    ctx = make_forward_context([1], cfg, range(stage.start_layer, stage.end_layer))
    with torch.inference_mode(), set_forward_context(ctx), expect_path(None, 1):
        compiled(None, pos, pp_proxy_tensors=proxies)


def test_interleaved_stages() -> None:
    """Stages 1 and 2 of one compiled pipeline, called alternately with different token counts."""
    cfg = REFERENCE_CONFIGS["small-dense"]
    eager = InProcessPipeline(cfg, PP, compiled=False)
    graphed = InProcessPipeline(cfg, PP, compiled=True, options=OPTIONS)
    counts = [(16, 40), (7, 64), (33, 3), (64, 16), (70, 9), (12, 12)]
    with torch.inference_mode():
        for n1, n2 in counts:
            outs = []
            for rank, n in ((1, n1), (2, n2)):
                _, pos, proxies = make_batch(cfg, [n], rank, PP, seed=n)
                want = eager.run_stage(rank, pos, [n], pp_proxy_tensors=proxies)
                got = graphed.run_stage(rank, pos, [n], pp_proxy_tensors=proxies)
                outs.append((got, want, rank, n))
            for got, want, rank, n in outs:  # stage 1's output survives a call of stage 2
                assert_close(got, want, f"stage {rank} at {n} tokens")


def test_same_class_different_weights() -> None:
    """Two instances of one stage class and config, different weights, compiled separately."""
    cfg_a = REFERENCE_CONFIGS["small-moe"]
    cfg_b = cfg_a.replace(seed=1)
    rank = 1
    stages = [make_stage(cfg_a, rank, PP), make_stage(cfg_b, rank, PP)]
    compiled = [torch.compile(s, backend="pp_breakable", dynamic=True, options=OPTIONS) for s in stages]
    with torch.inference_mode():
        for n in (16, 17, 40, 64):
            _, pos, proxies = make_batch(cfg_a, [n], rank, PP, seed=n)
            outs = []
            for stage, comp in zip(stages, compiled):
                layers = range(stage.start_layer, stage.end_layer)
                with set_forward_context(make_forward_context([n], cfg_a, layers)):
                    want = stage(None, pos, pp_proxy_tensors=proxies)
                with set_forward_context(make_forward_context([n], cfg_a, layers)):
                    got = comp(None, pos, pp_proxy_tensors=proxies)
                outs.append((got, want))
            for i, (got, want) in enumerate(outs):
                assert_close(got, want, f"instance {i} at {n} tokens")
            assert not torch.allclose(outs[0][1]["hidden_states"], outs[1][1]["hidden_states"])


def test_default_dynamic_none() -> None:
    """``dynamic=None``: the first call is traced static, later ones recompile dynamic; all correct."""
    cfg = REFERENCE_CONFIGS["small-dense"]
    eager = InProcessPipeline(cfg, PP, compiled=False)
    graphed = InProcessPipeline(cfg, PP, compiled=True, options=OPTIONS, dynamic=None)
    for lens in ([8, 8], [17], [40], [1], [63], [70], [16]):
        with torch.inference_mode():
            stagewise(graphed, eager, lens)
            ids, pos, _ = make_batch(cfg, lens, 0, PP, seed=2)
            want = eager(ids, pos, lens).clone()
            got = graphed(ids, pos, lens)
        assert_close(got, want, f"logits at {sum(lens)} tokens")
    assert [t.path for t in graphed.traces if t] == ["graph"] * PP  # the last 16 replays


_STREAM: dict[str, InProcessPipeline] = {}


def _stream_pipelines() -> tuple[InProcessPipeline, InProcessPipeline]:
    """One pair of pipelines for every Hypothesis example (compiling per example would be too slow)."""
    if not _STREAM:
        cfg: ModelConfig = REFERENCE_CONFIGS["tiny"]
        _STREAM["eager"] = InProcessPipeline(cfg, PP, compiled=False)
        _STREAM["graphed"] = InProcessPipeline(cfg, PP, compiled=True, options=OPTIONS)
    return _STREAM["eager"], _STREAM["graphed"]


@pytest.fixture(scope="module", autouse=True)
def _drop_stream() -> Iterator[None]:
    yield
    _STREAM.clear()


@settings(max_examples=25, deadline=None)
@given(counts=st.lists(st.integers(1, CAP + 20), min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_random_token_streams(counts: list[int], seed: int) -> None:
    eager, graphed = _stream_pipelines()
    for i, n in enumerate(counts):
        lens = [n // 2, n - n // 2] if n >= 2 and (seed + i) % 2 else [n]
        ids, pos, _ = make_batch(eager.cfg, lens, 0, PP, seed=seed + i)
        before = ppcompile.counters.snapshot()
        with torch.inference_mode():
            want = eager(ids, pos, lens)
            got = graphed(ids, pos, lens)
        after = ppcompile.counters.snapshot()
        assert_close(got, want, f"logits at {n} tokens")
        replays = after["replays"] - before["replays"]
        assert replays + after["eager_runs"] - before["eager_runs"] == PP
        graphs = [rt for rt in ppcompile.stage_runtimes() if rt.eager_reason is None]
        served = n > 1 and graphs[0].plan.bucket(n) is not None
        assert replays == (PP if served else 0), f"{n} tokens: {replays} replays, plan serves it: {served}"

"""Capture safety: ops a CUDA graph cannot capture become breaks, whatever the graph mode or segment
compiler, so a stage that runs on CPU does not fail capture on a GPU for an op reason."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from cuda_double import StrictCuda
from fx_helpers import dynamo_graph, make_ctx, run_until
from torch import nn

import ppcompile
from ppcompile.analysis.node_facts import CAPTURE_UNSAFE, segments
from ppcompile.passes.check_capture_safety import check_capture_safety
from ppcompile.passes.split_at_breaks import split_at_breaks
from ppcompile.records import BreakKind
from ppcompile.runtime.executors import CudaGraphExecutor
from ppcompile.tracing.regions import undeclare

SIZES = [4, 8]
COUNTS = [1, 4, 5, 8, 9]  # one token, a bucket, a bucket + 1, the cap, above it


@torch.library.custom_op("pptest_capture::offset_scale", mutates_args=())
def offset_scale(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Scales rows by their group, groups read on the host (as transformers' grouped_mm_fallback)."""
    out = torch.empty_like(x)
    start = 0
    for i, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] * (i + 1)
        start = end
    return out


@offset_scale.register_fake
def _(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("pptest_capture::device_scale", mutates_args=())
def device_scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same kind of op, kept on the device."""
    return x * w.sum()


@device_scale.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Grouped(nn.Module):
    """Token-local as a whole: sorts rows by a key, scales each group, puts rows back."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        key = (h[:, 0] > 0).long()
        order = torch.argsort(key, stable=True)
        counts = torch.histc(key.float(), bins=2, min=0, max=1).long()
        scaled = offset_scale(h[order], counts.cumsum(0))
        out = torch.empty_like(h)
        out[order] = scaled
        return out


class Stage(nn.Module):
    def __init__(self, host_read: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.ones(3))
        self.grouped = Grouped() if host_read else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.proj(h)
        h = self.grouped(h) if self.grouped is not None else device_scale(h, self.w)
        return torch.relu(h) + 1


@pytest.fixture
def _declared() -> Iterator[None]:
    ppcompile.token_local(Grouped)
    yield
    undeclare(Grouped)


def _segments(module: nn.Module) -> list[object]:
    gm, inputs = dynamo_graph(module, torch.randn(6, 8))
    ctx = make_ctx(gm, inputs, capture_sizes=SIZES, token_local_ops=["pptest_capture::device_scale"])
    return list(segments(run_until(gm, ctx, split_at_breaks)))


@pytest.mark.usefixtures("_declared")
def test_a_host_read_in_a_token_local_region_makes_the_region_one_break() -> None:
    breaks = [s for s in _segments(Stage(host_read=True)) if not s.is_graph]  # type: ignore[attr-defined]
    assert len(breaks) == 1
    (reason,) = (s.reason for s in breaks)  # type: ignore[attr-defined]
    assert reason.kind is BreakKind.CAPTURE_UNSAFE
    assert "offset_scale" in reason.op and "argsort" in reason.op  # the whole region: sort to scatter
    assert "reads a device value on the host" in reason.detail


def test_a_custom_op_that_stays_on_the_device_stays_graphed() -> None:
    assert all(s.is_graph for s in _segments(Stage(host_read=False)))  # type: ignore[attr-defined]


def test_the_pass_marks_the_node_and_leaves_the_graph_alone() -> None:
    gm, inputs = dynamo_graph(lambda h, o: offset_scale(h, o) + 1, torch.randn(6, 8),
                              torch.tensor([2, 6]))
    ctx = make_ctx(gm, inputs, capture_sizes=SIZES)
    before = str(gm.graph)
    gm = run_until(gm, ctx, check_capture_safety)
    assert str(gm.graph) == before
    marked = {n.name: CAPTURE_UNSAFE.of(n) for n in gm.graph.nodes if CAPTURE_UNSAFE.has(n)}
    (name,) = marked
    assert "offset_scale" in name and "its implementation reads a device value on the host" in marked[name]


def _check_counts(graphed: nn.Module, stage: nn.Module) -> None:
    with torch.inference_mode():
        for n in COUNTS:
            h = torch.randn(n, 8, generator=torch.Generator().manual_seed(n))
            torch.testing.assert_close(graphed(h), stage(h), msg=lambda m, n=n: f"{n} tokens: {m}")


@pytest.mark.usefixtures("_declared", "fresh_dynamo")
def test_the_stage_captures_under_the_strict_double_and_matches_eager(strict_cuda: StrictCuda) -> None:
    stage = Stage(host_read=True).eval()
    old = ppcompile.stage_runtimes()
    _check_counts(torch.compile(stage, backend="pp_breakable", dynamic=True,  # graph path: the double's
                                options={"capture_sizes": SIZES, "graph_mode": "emulate"}), stage)
    (rt,) = [rt for rt in ppcompile.stage_runtimes()
             if not any(rt is o for o in old) and rt.token_symbol is not None]  # 1 token: eager
    assert "capture-unsafe op" in rt.describe()
    assert all(isinstance(state.executor, CudaGraphExecutor) for state in rt.instances())
    assert all(state.captured_buckets == tuple(SIZES) for state in rt.instances())


@pytest.mark.slow
@pytest.mark.usefixtures("_declared", "fresh_dynamo")
def test_inductor_segments_split_the_same_way() -> None:
    """The verdicts come before segment compilation: Inductor segments break at the same op (checked on
    the emulation: the double cannot replay Inductor's CPU kernels)."""
    stage = Stage(host_read=True).eval()
    old = ppcompile.stage_runtimes()
    options = {"capture_sizes": SIZES, "segment_compiler": "inductor", "graph_mode": "emulate"}
    _check_counts(torch.compile(stage, backend="pp_breakable", dynamic=True, options=options), stage)
    (rt,) = [rt for rt in ppcompile.stage_runtimes()
             if not any(rt is o for o in old) and rt.token_symbol is not None]  # 1 token: eager
    assert "capture-unsafe op" in rt.describe()


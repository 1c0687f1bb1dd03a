"""Ops that write a static value in place: a lifted stage input (an op updating ``residual`` in place, as
vLLM's ``fused_add_rms_norm`` does) or a bridged break output, written by a break or by a graph.

On the graph path a break reads and writes live tensors while graphs read static buffers. A value a break
writes is copied into its buffer again after the break (``BreakStep.refreshes``); a value a graph writes is
read back from its buffer by the breaks and outputs after it (``GraphStep.writes_buffers``), and an input is
copied back into the caller's tensor at the end. Either way the caller's tensors end as eager leaves them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from mixer_stage import mix_rows, register_mixer
from plan_variants import compile_recorded, map_steps, with_program
from runtime_helpers import symbolic_runtime

import ppcompile
from ppcompile.debug.report import build_report
from ppcompile.models.layers import fused_add_rms_norm

H = 8
SIZES = [4, 8, 16]
COUNTS = [1, 3, 4, 5, 8, 9, 16, 17]  # one token, every bucket exactly and off it, above the cap
pytestmark = pytest.mark.usefixtures("fresh_dynamo", "one_thread")
ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = pytest.param("cuda", marks=ON_GPU)


def _modes_x_compilers(modes: list[str], on_cuda: str) -> list[Any]:
    """Each CPU graph mode with both segment compilers, and CUDA graphs with one (each CUDA compile
    counts against bench/gpu_check.sh's time limit)."""
    pairs: list[Any] = [(mode, compiler) for mode in modes for compiler in ("eager", "inductor")]
    return [*pairs, pytest.param("cuda", on_cuda, marks=ON_GPU)]


@torch.library.custom_op("pptest_inplace::add_norm_", mutates_args=("x", "residual"))
def add_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    """``residual += x``, then ``x = rms_norm(residual) * weight``: both in place. Mixes rows, so that
    graphs cannot hold it."""
    residual.add_(x)
    x.copy_(mix_rows(residual) * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + 1e-6) * weight)


@add_norm_.register_fake
def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    return None


mix = register_mixer("pptest_inplace::mix", lambda x: None)


@torch.library.custom_op("pptest_inplace::scale_by_", mutates_args=("x",))
def scale_by_(x: torch.Tensor, by: torch.Tensor) -> None:
    x.mul_(mix_rows(by))


@scale_by_.register_fake
def _(x: torch.Tensor, by: torch.Tensor) -> None:
    return None


SPLIT_OPS = ["pptest_inplace::add_norm_", "pptest_inplace::mix", "pptest_inplace::scale_by_"]


class AddNormStage(torch.nn.Module):
    """graph (up) | break (``add_norm_(h, residual)``: writes h, a graph output, and residual, a lifted
    input) | graph (down, reads both)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(H, H), torch.nn.Linear(H, H)
        self.weight = torch.nn.Parameter(torch.rand(H) + 0.5)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.up(x)
        add_norm_(h, residual, self.weight)
        y = self.down(h) + residual * 2
        return y, residual


class ReceivingLayerStage(AddNormStage):
    """A non-first PP stage's first layer, as vLLM writes it: ``fused_add_rms_norm(x, residual)`` (the
    reference models' op, registered token-local) on the two
    tensors the previous stage sent, then graph (up) | break (mix) | graph (down, reads residual)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fused_add_rms_norm(x, residual, self.weight, 1e-6)
        h = mix(self.up(x))
        return self.down(h) + residual, residual


class RewrittenBridgeStage(torch.nn.Module):
    """graph | break (``m = mix(h)``, bridged) | graph (g, not reading m) | break (``scale_by_(m, g)``:
    writes the bridged m) | graph (reads m)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.side, self.down = (torch.nn.Linear(H, H) for _ in range(3))

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = mix(torch.relu(self.up(x + residual)))
        g = torch.sigmoid(self.side(x))
        scale_by_(m, g)
        y = self.down(m)
        return y, y + residual


class GraphRewritesBridgeStage(RewrittenBridgeStage):
    """break (``m = mix(h)``, bridged) | graph (``m.mul_(2)``: writes the bridge in place; side) |
    break (``mix(m)``) | graph; returns ``m`` too."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = mix(torch.relu(self.up(x + residual)))
        m.mul_(2)
        y = self.side(m)
        return self.down(mix(m)) + y, m


def _compare(c: Any, m: torch.nn.Module, n: int, seed: int, device: str) -> None:
    """The compiled stage against eager on fresh copies of the same inputs: outputs, and the inputs as
    the call left them (a break writes the caller's tensors in place, as eager does)."""
    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(n, H, generator=g).to(device) for _ in range(2))
    mine, theirs = (x.clone(), r.clone()), (x.clone(), r.clone())
    ppcompile.mark_token_dynamic(*mine)
    for got, want in zip((*c(*mine), *mine), (*m(*theirs), *theirs)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _options(mode: str, compiler: str, **extra: Any) -> dict[str, Any]:
    return {"graph_mode": mode, "segment_compiler": compiler, "capture_sizes": SIZES, "split_ops": SPLIT_OPS,
            **extra}


@pytest.mark.parametrize(("mode", "compiler"), _modes_x_compilers(["emulate", "eager", "none"], "inductor"))
def test_a_break_writing_a_lifted_input_in_place_refreshes_its_buffer(mode: str, compiler: str) -> None:
    device = "cuda" if mode == "cuda" else "cpu"
    m = AddNormStage().to(device)
    c = torch.compile(m, backend="pp_breakable", options=_options(mode, compiler))
    graphed = mode != "none"
    with torch.no_grad(), ppcompile.counters.expect(replays=6 if graphed else 0):
        for i, n in enumerate(COUNTS):
            _compare(c, m, n, i, device)
    runtime = symbolic_runtime(m)
    program = runtime.program
    (brk,) = [st for st in program.steps if not st.segment.is_graph]
    residual_slot = next(s for s, (name, _) in program.input_layouts.items() if "residual" in name)
    assert brk.refreshes == (residual_slot,) and len(brk.in_place) == 1 and brk.bridges == ()
    (segment,) = [s for s in build_report(runtime)["segments"] if s["index"] == brk.index]
    assert segment["writes_static"] == [program.input_buffers[residual_slot].name]


@pytest.mark.parametrize(("mode", "compiler"), _modes_x_compilers(["emulate", "eager"], "eager"))
def test_a_token_local_op_writing_the_stage_inputs_stays_in_the_graph_and_its_writes_reach_everyone(
    mode: str, compiler: str
) -> None:
    """Registered token-local, the op writes the stage's inputs inside the first graph, that is their
    static buffers: the break after it reads ``x`` from the buffer, and both inputs are copied back into
    the caller's tensors (``_compare`` checks them against eager's)."""
    device = "cuda" if mode == "cuda" else "cpu"
    m = ReceivingLayerStage().to(device)
    c = torch.compile(m, backend="pp_breakable", options=_options(mode, compiler))
    with torch.no_grad(), ppcompile.counters.expect(replays=6):
        for i, n in enumerate(COUNTS):
            _compare(c, m, n, i, device)
    program = symbolic_runtime(m).program
    first = program.steps[0]
    written = [program.input_layouts[s][0].lower() for s in first.writes_buffers]
    assert first.segment.is_graph and written == ["l_x_", "l_residual_"], written
    (segment,) = [s for s in build_report(symbolic_runtime(m))["segments"] if s["index"] == first.index]
    assert segment["writes_in_place"] == [program.input_buffers[s].name for s in first.writes_buffers]
    assert [r.op for r in symbolic_runtime(m).break_reasons] == ["pptest_inplace.mix.default"]


@pytest.mark.parametrize("mode", ["emulate", "eager", CUDA])
def test_a_break_writing_a_bridged_value_in_place_refreshes_its_bridge(mode: str) -> None:
    device = "cuda" if mode == "cuda" else "cpu"
    m = RewrittenBridgeStage().to(device)
    c = torch.compile(m, backend="pp_breakable", options=_options(mode, "inductor", fold_graph_ops=0))
    with torch.no_grad(), ppcompile.counters.expect(replays=6):
        for i, n in enumerate(COUNTS):
            _compare(c, m, n, i, device)
    first, second = [st for st in symbolic_runtime(m).program.steps if not st.segment.is_graph]
    (bridge,) = first.bridges
    assert second.refreshes == (bridge,) and second.bridges == ()


@pytest.mark.usefixtures("interpret")
def test_the_fused_copier_refreshes_in_the_breaks_copy_point() -> None:
    m = AddNormStage()
    c = torch.compile(m, backend="pp_breakable", options=_options("emulate", "eager", copy_kernel="triton"))
    with torch.no_grad(), ppcompile.counters.expect(replays=3):
        for i, n in enumerate([3, 8, 9, 17]):
            _compare(c, m, n, i, "cpu")
    (state,) = symbolic_runtime(m).instances()
    assert state.copy_kernel == "triton"
    (code,) = [code for what, code in symbolic_runtime(m).generated_code().items() if "fused copies" in what]
    assert "copy_1 = copiers[1]" in code and "copy_1((" in code  # the break's point: the residual, refreshed


def _stale(m: torch.nn.Module, change: Callable[[Any], Any]) -> tuple[Any, Any, Any]:
    """``m`` compiled and called once on 5 tokens, a runtime of it whose steps are ``change(step)``,
    what that runtime returns at its second call (the first captures), and what the right one does."""
    c, recorded = compile_recorded(m, _options("emulate", "eager", fold_graph_ops=0))
    with torch.no_grad():
        _compare(c, m, 5, 0, "cpu")
        changed = with_program(recorded.runtime, map_steps(recorded.runtime.program, change))
        want = recorded.runtime(*recorded.args())
        with ppcompile.counters.expect(replays=2):
            for _ in range(2):  # the first call captures
                got = changed(*recorded.args())
    return changed, got, want


def test_without_the_refresh_later_graphs_read_the_stale_input() -> None:
    """What the refresh prevents: the graph after the break reads the residual copied in before it."""
    def without_refresh(st: Any) -> Any:
        if st.is_graph or st.copies is None:
            return st
        point = st.copies
        keep = tuple(s for s in point.slots if s not in point.refreshes)
        return dataclasses.replace(st, copies=dataclasses.replace(
            point, slots=keep, fused=tuple(s for s in point.fused if s in keep), refreshes=()))

    _, got, want = _stale(AddNormStage(), without_refresh)
    assert not torch.allclose(got[0], want[0], atol=1e-3)


@pytest.mark.parametrize(("mode", "compiler"), _modes_x_compilers(["emulate", "eager"], "inductor"))
def test_a_graph_writing_a_bridged_value_in_place_is_read_back_by_the_break_after_it(
    mode: str, compiler: str
) -> None:
    """The bridge holds a copy of the break's output: after the graph doubles it there, the next break
    and the stage's output read the doubled rows from the bridge, not the break's own tensor."""
    device = "cuda" if mode == "cuda" else "cpu"
    m = GraphRewritesBridgeStage().to(device)
    c = torch.compile(m, backend="pp_breakable", options=_options(mode, compiler, fold_graph_ops=0))
    with torch.no_grad(), ppcompile.counters.expect(replays=6):
        for i, n in enumerate(COUNTS):
            _compare(c, m, n, i, device)
    program = symbolic_runtime(m).program
    (writer,) = [st for st in program.graph_steps if st.writes_buffers]
    assert writer.segment.is_graph and writer.writes_buffers == tuple(program.bridge_buffers)[:1]
    # The output and the break after the writer read the written bridge's buffer: the next bridge must
    # not reuse it (lowering/bridge_memory.py).
    assert all(plan.shares_with is None for plan in program.buffers.values())


def test_without_reading_back_a_graphs_writes_the_break_after_it_reads_stale_rows() -> None:
    """What ``writes_buffers`` prevents: the next break and the output read the break's own tensor."""
    def without_read_back(st: Any) -> Any:
        return dataclasses.replace(st, writes_buffers=()) if st.is_graph else st

    _, got, want = _stale(GraphRewritesBridgeStage(), without_read_back)
    assert not torch.allclose(got[1], want[1], atol=1e-3) and not torch.allclose(got[0], want[0], atol=1e-3)

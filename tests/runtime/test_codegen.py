"""The generated live forward (``runtime/codegen.py``) and the layout checks it makes for Inductor
segments compiled without Inductor's input asserts."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
import sympy
import torch
from mixer_stage import MixerStage, mix_rows, register_mixer
from plan_variants import RecordedStage, compile_recorded, with_program
from runtime_helpers import symbolic_runtime

import ppcompile
from ppcompile.records import Segment
from ppcompile.runtime.codegen import make_live_forward
from ppcompile.runtime.graph_codegen import graph_forward_source, make_graph_forward
from ppcompile.runtime.layout_checks import LayoutMismatchError, checked_values
from ppcompile.runtime.program import BreakStep, GraphStep, Program, Ref
from ppcompile.runtime.stage_runtime import StageRuntime
from ppcompile.runtime.static_buffers import TensorLayout, follows_token_count
from ppcompile.runtime.validation import InputMismatchError
from ppcompile.symbolic import SizeFn

H = 8
pytestmark = pytest.mark.usefixtures("fresh_dynamo", "one_thread")

mixer = register_mixer("pptest_live::mixer", lambda x: None)


@torch.library.custom_op("pptest_live::column_major", mutates_args=())
def column_major(x: torch.Tensor) -> torch.Tensor:
    """The mixer, returned column-major: its fake implementation below says row-major."""
    return mix_rows(x).t().contiguous().t()


@column_major.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("pptest_live::one_row_short", mutates_args=())
def one_row_short(x: torch.Tensor) -> torch.Tensor:
    """The mixer without its last row: its fake implementation below promises every row."""
    return mix_rows(x)[:-1].clone()


@one_row_short.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("pptest_live::as_double", mutates_args=())
def as_double(x: torch.Tensor) -> torch.Tensor:
    """The mixer in float64: its fake implementation below keeps the input's dtype."""
    return mix_rows(x).double()


@as_double.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("pptest_live::heads_first", mutates_args=())
def heads_first(x: torch.Tensor) -> torch.Tensor:
    """The mixer of ``x [T, 16]`` as two heads, ``[2, T, 8]`` laid out token-major (strides (8, 16, 1)),
    as attention kernels return ``[heads, T, dim]``; its fake implementation says the same."""
    return mix_rows(x).view(x.shape[0], 2, 8).transpose(0, 1).clone()


@heads_first.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty_strided((2, x.shape[0], 8), (8, 16, 1))


@torch.library.custom_op("pptest_live::honest_column_major", mutates_args=())
def honest_column_major(x: torch.Tensor) -> torch.Tensor:
    """The mixer, column-major; its fake implementation says column-major too."""
    return mix_rows(x).t().contiguous().t()


@honest_column_major.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty_strided(x.shape, (1, x.shape[0]))


class HeadsStage(torch.nn.Module):
    """graph (up) | break (heads_first) | graph (merge heads, down)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(H, 2 * H), torch.nn.Linear(2 * H, H)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        heads = torch.ops.pptest_live.heads_first(torch.relu(self.up(x + residual)))
        out = self.down(heads.transpose(0, 1).reshape(x.shape[0], 2 * H))
        return out, out + residual


def _compile(m: torch.nn.Module, **options: Any) -> Any:
    guard_filter_fn = options.pop("guard_filter_fn", None)
    opts: dict[str, Any] = {"segment_compiler": "inductor", "graph_mode": "none", **options}
    if guard_filter_fn is not None:
        opts["guard_filter_fn"] = guard_filter_fn
    return torch.compile(m, backend="pp_breakable", options=opts)


def _inputs(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, r = torch.randn(n, H, generator=g), torch.randn(n, H, generator=g)
    ppcompile.mark_token_dynamic(x, r)
    return x, r


def _check(c: Any, m: torch.nn.Module, x: torch.Tensor, r: torch.Tensor) -> None:
    for got, want in zip(c(x, r), m(x, r)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _source(m: torch.nn.Module) -> str:
    return str(symbolic_runtime(m).generated_code()["live"])


def test_generated_forward_is_straight_line_and_matches_eager() -> None:
    m = MixerStage(torch.ops.pptest_live.mixer, H)
    c = _compile(m)
    with torch.no_grad():
        for i, n in enumerate([5, 16, 1, 17]):
            _check(c, m, *_inputs(n, seed=i))
    runtime = symbolic_runtime(m)
    source = _source(m)
    assert "for " not in source and "while " not in source
    for step in runtime.program.steps:  # each segment called once, in program order
        assert source.count(f"call_{step.index}(") == 1
    calls = [source.index(f"call_{st.index}(") for st in runtime.program.steps]
    assert calls == sorted(calls)
    # Inductor segments run without Inductor's input asserts: the stage inputs and the break output
    # that compiled segments read are checked instead, once each.
    assert source.count("layouts.repair(") == 3


def test_segments_keep_their_asserts_when_asked_and_then_nothing_is_checked_twice() -> None:
    m = MixerStage(torch.ops.pptest_live.mixer, H)
    c = _compile(m, inductor_config={"size_asserts": True})
    with torch.no_grad():
        _check(c, m, *_inputs(6))
    assert "layouts" not in _source(m)
    c = _compile(MixerStage(torch.ops.pptest_live.mixer, H), segment_compiler="eager")
    with torch.no_grad():
        c(*_inputs(6))
    assert "layouts" not in _source(m)


def test_a_break_output_in_another_layout_than_traced_is_copied_into_the_traced_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    m = MixerStage(torch.ops.pptest_live.column_major, H)
    c = _compile(m)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="ppcompile"):
        for i, n in enumerate([5, 12, 7]):
            x, r = _inputs(n, seed=i)
            assert not column_major(x).is_contiguous()
            _check(c, m, x, r)
    warnings = [r.getMessage() for r in caplog.records if "traced layout" in r.getMessage()]
    assert len(warnings) == 1 and "fake implementation" in warnings[0], warnings


def test_a_break_output_of_another_shape_than_traced_raises_naming_the_segment() -> None:
    m = MixerStage(torch.ops.pptest_live.one_row_short, H)
    c = _compile(m)
    with torch.no_grad(), pytest.raises(LayoutMismatchError, match=r"break segment submod_\d.*shape \[4, 16\]"
                                        r".*shape \[5, 16\].*fake implementation") as info:
        c(*_inputs(5))
    assert any("raised in segment submod_" in note for note in getattr(info.value, "__notes__", []))


def test_a_break_output_of_another_dtype_than_traced_raises() -> None:
    c = _compile(MixerStage(torch.ops.pptest_live.as_double, H))
    with torch.no_grad(), pytest.raises(LayoutMismatchError, match=r"break segment submod_\d.*returned dtype "
                                        r"torch.float64.*has dtype torch.float32"):
        c(*_inputs(5))


def _no_guards(entries: list[Any]) -> list[bool]:
    return [False] * len(entries)


def test_without_guards_live_inputs_are_checked_before_compiled_segments_read_them() -> None:
    m = MixerStage(torch.ops.pptest_live.mixer, H)
    c = _compile(m, guard_filter_fn=_no_guards)
    with torch.no_grad():
        _check(c, m, *_inputs(6))
        x, r = _inputs(6, seed=1)
        x_columns = x.t().contiguous().t()  # same values, other strides: eager's answer
        _check(c, m, x_columns, r)
        with pytest.raises(InputMismatchError, match=r"input 'l_residual_' .*expected shape \[6, 8\], "
                                                     r"got shape \[6, 1\].*guards"):
            c(x, r[:, :1])
        with pytest.raises(InputMismatchError, match=r"input 'l_x_' .*expected dtype torch.float32, "
                                                     r"got dtype torch.float64"):
            c(x.double(), r)
        _check(c, m, *_inputs(9, seed=2))  # the next valid call is correct


def test_inductor_segments_are_called_without_dynamos_disable_wrapper() -> None:
    m = MixerStage(torch.ops.pptest_live.mixer, H)
    c = _compile(m)
    with torch.no_grad():
        _check(c, m, *_inputs(6))
    graph_steps = [st for st in symbolic_runtime(m).program.steps if st.segment.is_graph]
    multi = [st for st in graph_steps if not st.single_output]
    assert multi, "the stage has a graph segment with several outputs"
    for st in multi:  # the runtime itself is called through Dynamo's disable wrapper
        assert not getattr(st.call, "_torchdynamo_disable", False)


@pytest.mark.parametrize("binds_inputs, pass_args", [(True, False), (True, True), (False, True)])
def test_graph_path_source_replays_each_graph_segment_once_in_order(
    binds_inputs: bool, pass_args: bool
) -> None:
    m = MixerStage(torch.ops.pptest_live.mixer, H)
    c = _compile(m, graph_mode="emulate", capture_sizes=[8, 16])
    with torch.no_grad():
        for i, n in enumerate([5, 8, 9, 17]):  # a bucket, exactly a bucket, bucket + 1, above the cap
            _check(c, m, *_inputs(n, seed=i))
    runtime = symbolic_runtime(m)
    program = runtime.program
    assert runtime.token_symbol is not None
    source, _ = graph_forward_source(program, runtime.token_symbol, binds_inputs, pass_args)
    assert "for " not in source and "while " not in source
    # Bound once per bucket: the per-call function takes the live inputs, the call's symbols, n.
    assert "def bind_graph_forward(b, table, replays, copiers, ring, views, marks):" in source
    assert "    def graph_forward(args, env_n, n):" in source
    order = []
    for st in program.steps:
        head = f"replay_{st.index}(" if st.segment.is_graph else f"call_{st.index}("
        assert source.count(head) == 1, (head, source)
        order.append(source.index(head))
    assert order == sorted(order)
    graph_steps = [st for st in program.steps if st.segment.is_graph]
    # One replay callable per graph step, bound with the bucket's table.
    assert f"{', '.join(f'replay_{st.index}' for st in graph_steps)}, = replays" in source
    # A bound graph reads what it captured: it is handed nothing unless the debug check wants it.
    assert (sum(source.count(f"replay_{st.index}()") for st in graph_steps) == len(graph_steps)) == (
        not pass_args)
    # Outputs of non-binding replays land in the call's table; bound ones stay where they were captured.
    assert ("] = o[" in source) == (not binds_inputs)
    assert ("static = list(table)" in source) == (not binds_inputs)
    # Each input buffer is filled once, through its live rows (one-dim copies are written inline).
    inputs = program.input_buffers
    assert sum(source.count(f"dst{s}.copy_(v{s})") for s in inputs) == len(inputs)


def _ident(*args: Any) -> Any:
    return args[0]


def test_only_layouts_of_symbols_a_call_binds_are_checked() -> None:
    """A value whose size or stride names a symbol the call does not bind (Dynamo guards it) is not
    checked: its expected layout could not be computed per call."""
    n, h = sympy.Symbol("n", integer=True, positive=True), sympy.Symbol("h", integer=True, positive=True)
    four, one = SizeFn(sympy.Integer(4)), SizeFn(sympy.Integer(1))
    cpu = torch.device("cpu")
    known_layout = TensorLayout((SizeFn(n), four), (four, one), torch.float32, cpu)  # [n, 4]
    guarded_layout = TensorLayout((SizeFn(n), SizeFn(h)), (SizeFn(h), one), torch.float32, cpu)  # h: guarded
    graph, brk = Segment("g", "graph", 1), Segment("b", "break", 1)
    steps = (
        BreakStep(0, brk, _ident, (Ref(slot=0),), (2,), out_layouts=(known_layout,)),
        BreakStep(1, brk, _ident, (Ref(slot=1),), (3,), out_layouts=(guarded_layout,)),
        GraphStep(2, graph, _ident, (Ref(slot=0), Ref(slot=1), Ref(slot=2), Ref(slot=3)), (4,)),
    )
    layouts = {0: ("x", known_layout), 1: ("y", guarded_layout)}
    program = Program(num_slots=5, num_inputs=2, steps=steps, outputs=(Ref(slot=4),), token_dims={},
                      input_layouts=layouts)
    assert [c.slot for c in checked_values(program, [0, 1], {n})] == [0, 2]
    assert [c.slot for c in checked_values(program, [0, 1], {n, h})] == [0, 1, 2, 3]
    assert [c.slot for c in checked_values(program, [1], {n, h})] == [1, 2, 3]  # input 0 is not live


def test_strides_follow_the_token_count_only_on_dims_longer_than_one() -> None:
    """Column-major [T, H] has a stride that follows T; [1, T, H] row-major too, but only on its size-1
    dim, which addresses nothing else: narrowed views serve it, and fused copiers keep it."""
    t = sympy.Symbol("s0", integer=True, positive=True)
    one, four, tokens = SizeFn(sympy.Integer(1)), SizeFn(sympy.Integer(4)), SizeFn(t)
    cpu = torch.device("cpu")
    column_major = TensorLayout((tokens, four), (one, tokens), torch.float32, cpu)
    batch_of_one = TensorLayout((one, tokens, four), (SizeFn(4 * t), four, one), torch.float32, cpu)
    row_major = TensorLayout((tokens, four), (four, one), torch.float32, cpu)
    assert [follows_token_count(layout, t) for layout in (column_major, batch_of_one, row_major)] == [
        True, False, False]
    assert not follows_token_count(column_major, None)


def test_a_program_without_steps_returns_its_inputs_and_constants() -> None:
    program = Program(num_slots=1, num_inputs=1, steps=(), outputs=(Ref(slot=0), 3), token_dims={})
    x = torch.ones(2)
    assert make_live_forward(program)((x,), {}) == (x, 3)
    bind = make_graph_forward(program, "stage", sympy.Symbol("s0"), True, False)
    graph_forward = bind(2, [], (), None, None, {}, [])  # bucket 2: its table, no replays, copiers, ring
    assert graph_forward((x,), {}, 2) == (x, 3)


def test_a_static_buffer_keeps_the_traced_layout_of_what_it_holds() -> None:
    """A break output laid out token-major but not token-first ([heads, T, dim], as attention returns it)
    gets a bridge buffer in that layout, so the Inductor segment that reads it replays correctly."""
    m = HeadsStage()
    c = _compile(m, graph_mode="emulate", capture_sizes=[8, 16])
    with torch.no_grad(), ppcompile.counters.expect(replays=3, eager_runs=1):
        for i, n in enumerate([5, 8, 9, 17]):
            _check(c, m, *_inputs(n, seed=i))
    (state,) = symbolic_runtime(m).instances()
    (bridge,) = state.bridge_buffers.values()
    assert bridge.shape == (2, 16, 8) and bridge.stride() == (8, 16, 1)


def test_a_column_major_bridge_is_viewed_with_each_buckets_strides_and_graphs_serve() -> None:
    """Column-major [T, H] (strides [1, T]): a narrowed view of one buffer would keep the largest
    bucket's column stride; each bucket views the buffer's memory with its own, so graphs serve every
    bucket and match eager."""
    m = MixerStage(torch.ops.pptest_live.honest_column_major, H)
    c = _compile(m, graph_mode="emulate", capture_sizes=[8, 16])
    with torch.no_grad(), ppcompile.counters.expect(replays=3, eager_runs=1):
        for i, n in enumerate([5, 8, 9, 17]):  # a bucket, exactly a bucket, a bucket + 1, above the cap
            _check(c, m, *_inputs(n, seed=i))
    (state,) = symbolic_runtime(m).instances()
    (bridge,) = state.bridge_buffers.values()
    width = bridge.shape[1]
    assert bridge.shape == (16, width) and bridge.stride() == (1, 16)
    views = {(tuple(t.shape), t.stride()) for t in state.static_tensors()}
    assert ((8, width), (1, 8)) in views and ((16, width), (1, 16)) in views  # what graphs read per bucket


class ColumnMajorReader(torch.nn.Module):
    """graph (up) | break (column-major mixer output) | graph (fused elementwise reader of it, down)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(H, H), torch.nn.Linear(H, H)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.ops.pptest_live.honest_column_major(torch.relu(self.up(x + residual)))
        out = self.down(torch.sigmoid(h) * 2 + h)
        return out, out + residual


def _narrowed_bucket_views(layout_check: bool) -> tuple[StageRuntime, RecordedStage]:
    """A compiled ``ColumnMajorReader`` and a runtime of it whose bridge is narrowed from the largest
    bucket's buffer (as before buffers whose strides follow the token count were viewed per bucket),
    with or without the capture-time layout check."""
    m = ColumnMajorReader()
    c, recorded = compile_recorded(m, {"segment_compiler": "inductor", "graph_mode": "emulate",
                                       "capture_sizes": [8, 16]})
    with torch.no_grad():
        _check(c, m, *_inputs(5))
    program = recorded.runtime.program
    (bridge,) = [p for p in program.buffers.values() if p.per_bucket_strides]
    narrowed = dataclasses.replace(bridge, per_bucket_strides=False,
                                   layout=bridge.layout if layout_check else None)
    changed = dataclasses.replace(program, buffers={**program.buffers, bridge.slot: narrowed})
    return with_program(recorded.runtime, changed), recorded


def test_with_narrowed_bucket_views_and_no_layout_check_a_column_major_reader_is_wrong() -> None:
    """What per-bucket views and the capture check prevent: the fused reader was compiled for the
    bucket's column stride, a narrowed view has the largest bucket's, so the replay reads the wrong
    elements."""
    narrowed, recorded = _narrowed_bucket_views(layout_check=False)
    with torch.no_grad(), ppcompile.counters.expect(replays=1):
        got = narrowed(*recorded.args())[0]
    want = recorded.runtime.run_eager(recorded.args())[0]
    assert not torch.allclose(got, want, atol=1e-3)


def test_the_layout_check_catches_a_bucket_view_without_the_compiled_strides() -> None:
    """With narrowed views the capture check fails clearly, naming the value and both layouts, and the
    stage then runs eagerly and right."""
    narrowed, recorded = _narrowed_bucket_views(layout_check=True)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match=r"static buffer of the output 0 of break segment submod_\d "
                                               r"at bucket 8 .*strides \[1, 16\].*compiled for .*strides "
                                               r"\[1, 8\]"):
            narrowed(*recorded.args())
        want = recorded.runtime.run_eager(recorded.args())[0]
        with ppcompile.counters.expect(replays=0, eager_runs=2):
            for _ in range(2):
                torch.testing.assert_close(narrowed(*recorded.args())[0], want)


def test_a_fused_column_major_reader_replays_right_at_every_bucket() -> None:
    m = ColumnMajorReader()
    c = _compile(m, graph_mode="emulate", capture_sizes=[8, 16])
    with torch.no_grad(), ppcompile.counters.expect(replays=4, eager_runs=1):
        for i, n in enumerate([5, 8, 9, 16, 17]):
            _check(c, m, *_inputs(n, seed=i))


class TokenInnerStage(torch.nn.Module):
    """graph (up, and ``[H, T]`` row-major: the token dim inner) | break (mixer) | graph (reads both)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(H, H), torch.nn.Linear(H, H)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        columns = torch.relu(self.up(x)).t().contiguous()
        out = self.down(torch.ops.pptest_live.mixer(x + residual)) + columns.t() * 2
        return out, out + residual


def test_a_graph_output_with_the_token_dim_inner_replays_every_bucket_with_its_own_strides() -> None:
    """Under emulation smaller buckets view the largest bucket's outputs; a ``[H, T]`` row-major output
    viewed so keeps the largest T as its row stride, which the next compiled segment would misread: such
    an output gets its own memory per bucket instead."""
    m = TokenInnerStage()
    c = _compile(m, graph_mode="emulate", capture_sizes=[8, 16])
    with torch.no_grad(), ppcompile.counters.expect(replays=4, eager_runs=0):
        for i, n in enumerate([12, 5, 8, 9]):
            _check(c, m, *_inputs(n, seed=i))

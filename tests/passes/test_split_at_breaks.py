"""Tests of ``split_at_breaks``: which nodes become break segments, the segment records, and numerics."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from attention_modules import Attn, attention_context
from fx_helpers import dynamo_graph, make_ctx, run_until

import ppcompile
from ppcompile.analysis.node_facts import SEGMENT, TOKEN_DIMS, segments
from ppcompile.passes.split_at_breaks import split_at_breaks
from ppcompile.records import BREAK_KINDS, BreakKind, RunMerge, Segment


def _split(fn: Any, *args: Any, **options: Any):  # type: ignore[no-untyped-def]
    gm, ex = dynamo_graph(fn, *args)
    ctx = make_ctx(gm, ex, **options)
    split = run_until(gm, ctx, split_at_breaks)
    return split, ex, ctx


def _kinds(segments: list[Segment]) -> str:
    return "".join("g" if s.is_graph else "b" for s in segments)


def _assert_same(got: Any, want: Any) -> None:
    got_flat = torch.utils._pytree.tree_leaves(got)
    want_flat = torch.utils._pytree.tree_leaves(want)
    assert len(got_flat) == len(want_flat)
    for g, w in zip(got_flat, want_flat):
        torch.testing.assert_close(g, w)


def _check_records(split: torch.fx.GraphModule) -> None:
    """Each call node's segment names its submodule and counts its nodes."""
    calls = list(split.graph.find_nodes(op="call_module"))
    recorded = [SEGMENT.of(c) for c in calls]
    assert [s.name for s in recorded] == [str(c.target) for c in calls]
    for s in recorded:
        sub = getattr(split, s.name)
        assert s.num_nodes == sum(1 for n in sub.graph.nodes if n.op not in ("placeholder", "output"))
        assert (s.reason is None) == s.is_graph


def test_two_attention_calls_give_five_segments() -> None:
    m = Attn((4, 5))
    x = torch.randn(6, 8)
    with attention_context(6, (4, 5)):
        split, ex, _ = _split(m, x)
    assert _kinds(segments(split)) == "gbgbg"
    _check_records(split)
    breaks = [s for s in segments(split) if not s.is_graph]
    assert [s.layer_ids for s in breaks] == [(4,), (5,)]
    assert all(s.layer_ids == () for s in segments(split) if s.is_graph)
    for s, layer in zip(breaks, (4, 5)):
        assert s.reason is not None and s.reason.kind is BreakKind.ATTENTION
        assert s.reason.op == "ppcompile.attention"
        assert s.reason.detail == f"global layer {layer}"
        assert s.num_nodes == 1
        (node,) = [n for n in getattr(split, s.name).graph.nodes if n.op == "call_function"]
        assert node.target is torch.ops.ppcompile.attention
    graph_targets = [n.target for s in segments(split) if s.is_graph
                     for n in getattr(split, s.name).graph.nodes if n.op == "call_function"]
    assert torch.ops.ppcompile.attention not in graph_targets
    with attention_context(6, (4, 5)), torch.no_grad():
        _assert_same(split(*ex), (m(x),))


def test_back_to_back_attention_calls_share_one_break() -> None:
    def f(q: torch.Tensor) -> torch.Tensor:
        a = torch.ops.ppcompile.attention(q, q, q, 0)
        return torch.ops.ppcompile.attention(a, a, a, 1)

    q = torch.randn(5, 2, 4)
    with attention_context(5, (0, 1)):
        split, ex, _ = _split(f, q)
        assert _kinds(segments(split)) == "b"
        assert [s.layer_ids for s in segments(split)] == [(0, 1)]
        _check_records(split)
        with torch.no_grad():
            _assert_same(split(*ex), (f(q),))


def test_scaled_dot_product_attention_is_a_break() -> None:
    lin = torch.nn.Linear(8, 8)

    def f(x: torch.Tensor) -> torch.Tensor:
        q = lin(x).view(1, -1, 2, 4).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return out.transpose(1, 2).reshape(-1, 8) * 2

    x = torch.randn(6, 8)
    split, ex, _ = _split(f, x)
    assert _kinds(segments(split)) == "gbg"
    _check_records(split)
    reason = segments(split)[1].reason
    assert reason is not None and reason.kind is BreakKind.ATTENTION
    assert "scaled_dot_product_attention" in reason.op
    assert segments(split)[1].layer_ids == ()
    with torch.no_grad():
        _assert_same(split(*ex), (f(x),))


class _Mix(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.ops.pptest.mix(self.lin(x)))


@pytest.mark.parametrize(
    "op",
    ["pptest::mix", torch.ops.pptest.mix, torch.ops.pptest.mix.default],
    ids=["str", "packet", "overload"],
)
def test_user_split_op_as_string_packet_or_overload(op: Any) -> None:
    m = _Mix()
    x = torch.randn(6, 8)
    split, ex, _ = _split(m, x, split_ops=[op])
    assert _kinds(segments(split)) == "gbg"
    _check_records(split)
    reason = segments(split)[1].reason
    assert reason is not None and reason.kind is BreakKind.USER_SPLIT_OP
    assert reason.op == "pptest.mix"
    with torch.no_grad():
        _assert_same(split(*ex), (m(x),))


def test_user_op_is_not_a_split_op_unless_listed() -> None:
    # Unknown custom ops are padding-unsafe until declared token-local; then nothing breaks.
    split, _, _ = _split(_Mix(), torch.randn(6, 8))
    assert [s.reason.kind for s in segments(split) if s.reason] == [BreakKind.UNSAFE_OP]
    split, _, _ = _split(_Mix(), torch.randn(6, 8), token_local_ops=["pptest::mix"])
    assert _kinds(segments(split)) == "g"
    assert segments(split)[0].num_nodes == 3


def test_unknown_split_op_raises_naming_it() -> None:
    gm, ex = dynamo_graph(_Mix(), torch.randn(6, 8))
    ctx = make_ctx(gm, ex, split_ops=["pptest::no_such_op"])
    with pytest.raises(ValueError, match="pptest::no_such_op"):
        run_until(gm, ctx, split_at_breaks)


class _TwoCounts(torch.nn.Module):
    """``x [s0, 8]`` and ``y [s1, 8]``: ``cat`` and what follows it have size ``s0 + s1``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        both = torch.cat([h, y]) * 3
        return h * 2, both


def _segment_of(split: torch.fx.GraphModule, segments: list[Segment], target: Any) -> Segment:
    for s in segments:
        if any(n.target == target for n in getattr(split, s.name).graph.nodes):
            return s
    raise AssertionError(f"no segment holds {target}")


def test_non_token_dynamic_shape_is_a_break() -> None:
    m = _TwoCounts()
    x, y = torch.randn(6, 8), torch.randn(5, 8)
    split, ex, ctx = _split(m, x, y)
    assert len(ctx.other_symbols) == 1
    cat = _segment_of(split, segments(split), torch.cat)
    mul = _segment_of(split, segments(split), operator.mul)  # the first mul is ``* 3``
    assert cat is mul  # a run of non-token-shape nodes shares one break
    assert not cat.is_graph and cat.reason is not None
    assert cat.reason.kind is BreakKind.NON_TOKEN_SHAPE
    assert str(next(iter(ctx.other_symbols))) in cat.reason.detail
    assert segments(split)[0].is_graph  # the linear on x alone
    _check_records(split)
    with torch.no_grad():
        _assert_same(split(*ex), m(x, y))


def test_non_token_shape_through_a_method_call_is_a_break() -> None:
    """``Tensor.sin()`` is a ``call_method`` node: its ``s0 + s1`` shape must break like a function's."""
    lin = torch.nn.Linear(8, 8)

    def f(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = lin(x)
        return h * 2, torch.cat([h, y]).sin()

    x, y = torch.randn(6, 8), torch.randn(5, 8)
    split, ex, _ = _split(f, x, y)
    sin = _segment_of(split, segments(split), "sin")
    assert not sin.is_graph and sin.reason is not None and sin.reason.kind is BreakKind.NON_TOKEN_SHAPE
    with torch.no_grad():
        _assert_same(split(*ex), f(x, y))


def test_reading_a_non_token_shape_is_a_break() -> None:
    """``sum(0)`` of a ``[s1, 8]`` tensor has a static shape, but a graph cannot read its input."""
    lin = torch.nn.Linear(8, 8)

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return lin(x) + lin(y).sum(0)

    x, y = torch.randn(6, 8), torch.randn(5, 8)
    split, ex, _ = _split(f, x, y)
    reduce = _segment_of(split, segments(split), "sum")
    assert not reduce.is_graph and reduce.reason is not None
    assert reduce.reason.kind is BreakKind.NON_TOKEN_SHAPE
    with torch.no_grad():
        _assert_same(split(*ex), (f(x, y),))


def test_graph_without_breaks_is_one_graph_segment() -> None:
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    x = torch.randn(6, 8)
    split, ex, ctx = _split(m, x)
    assert _kinds(segments(split)) == "g"
    (call,) = split.graph.find_nodes(op="call_module")
    assert TOKEN_DIMS.get(call) == ((0, ctx.token_symbol),)  # copied from the segment's output
    with torch.no_grad():
        _assert_same(split(*ex), (m(x),))


class _IndexBreakOutput(torch.nn.Module):
    """Indexes a break's tensor output with an index computed later: not tuple unpacking."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x.cumsum(0)  # padding-unsafe: a break
        idx = torch.arange(x.shape[0]).flip(0)
        return c[idx] * 2


def test_indexing_a_break_output_is_not_pinned_to_the_break() -> None:
    torch._dynamo.reset()
    m = _IndexBreakOutput()
    options = {"capture_sizes": [4, 8], "graph_mode": "emulate"}
    compiled = torch.compile(m, backend="pp_breakable", dynamic=True, options=options)
    with torch.inference_mode():
        for n in (6, 7):
            x = torch.randn(n, 4)
            torch.testing.assert_close(compiled(x), m(x))


class _VmapMask(torch.nn.Module):
    """A causal mask built with torch.vmap (as transformers 4.x does): a region that cannot be cut."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.arange(x.shape[0])
        mask = torch.vmap(lambda i: t <= i)(t)
        return (mask.float() @ x) * 2


def test_a_vmap_region_with_a_break_is_one_break() -> None:
    torch._dynamo.reset()
    m = _VmapMask()
    options = {"capture_sizes": [4, 8], "graph_mode": "emulate"}
    compiled = torch.compile(m, backend="pp_breakable", dynamic=True, options=options)
    with torch.inference_mode():
        for n in (6, 7):
            x = torch.randn(n, 4)
            torch.testing.assert_close(compiled(x), m(x))
    runtime = ppcompile.stage_runtimes()[-1]
    vmap_breaks = [r for r in runtime.break_reasons if r.op.startswith("torch.vmap region")]
    assert len(vmap_breaks) == 1 and "_vmap_decrement_nesting" in vmap_breaks[0].op, runtime.describe()


class _TwoMixes(torch.nn.Module):
    """mix | ``views`` pairs of views and ``cheap_ops`` adds | mix, between two scalings."""

    def __init__(self, cheap_ops: int, views: int = 0) -> None:
        super().__init__()
        self.cheap_ops, self.views = cheap_ops, views
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.pptest.mix(x * self.scale)
        for _ in range(self.views):
            y = y.view(-1, 2, 4).view(-1, 8)
        for _ in range(self.cheap_ops):
            y = y + 1
        return torch.ops.pptest.mix(y) * self.scale


def _two_mixes(cheap_ops: int, views: int = 0) -> Any:
    return _TwoMixes(cheap_ops, views)


@pytest.mark.parametrize(("cheap_ops", "views", "fold", "kinds"), [
    (2, 0, 0, "gbgbg"),  # folding off
    (2, 0, 2, "gbg"),  # two ops <= 2: folded into one break
    (3, 0, 2, "gbgbg"),  # three ops > 2: kept
    (1, 4, 1, "gbg"),  # views launch nothing: one op counts
    (0, 2, 0, "gbg"),  # only views between the breaks: one break even with folding off
    (0, 0, 0, "gbg"),  # adjacent breaks: one break
])
def test_tiny_graph_segments_between_breaks_are_folded(
    cheap_ops: int, views: int, fold: int, kinds: str
) -> None:
    f = _two_mixes(cheap_ops, views)
    x = torch.randn(6, 8)
    split, ex, _ = _split(f, x, split_ops=["pptest::mix"], fold_graph_ops=fold)
    assert _kinds(segments(split)) == kinds
    _check_records(split)
    if kinds == "gbg":
        reason = segments(split)[1].reason
        assert reason is not None and reason.kind is BreakKind.USER_SPLIT_OP
        assert "joined with the next break" in reason.detail
        assert ("add" in reason.detail) == (cheap_ops > 0)
    with torch.no_grad():
        _assert_same(split(*ex), (f(x),))


def test_attention_and_the_cache_write_beside_it_are_one_break() -> None:
    """An engine's KV-cache write (a split op here) right before its attention op: one break segment,
    its reason the write's, the attention and its layer id joined."""

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = torch.ops.pptest.mix(x * self.scale).view(-1, 2, 4)
            return torch.relu(torch.ops.ppcompile.attention(q, q, q, 3))

    f, x = Layer(), torch.randn(5, 8)
    with attention_context(5, (3,)):
        split, ex, _ = _split(f, x, split_ops=["pptest::mix"])
        assert _kinds(segments(split)) == "gbg"
        _check_records(split)
        (brk,) = [s for s in segments(split) if not s.is_graph]
        assert brk.reason is not None and brk.reason.kind is BreakKind.USER_SPLIT_OP
        assert "joined with the next break (attention: ppcompile.attention" in brk.reason.detail
        assert brk.layer_ids == (3,)
        with torch.no_grad():
            _assert_same(split(*ex), (f(x),))


def test_a_kernel_between_two_breaks_keeps_them_apart_without_folding() -> None:
    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = (torch.ops.pptest.mix(x) + self.scale).view(-1, 2, 4)
            return torch.ops.ppcompile.attention(q, q, q, 3)

    f, x = Layer(), torch.randn(5, 8)
    with attention_context(5, (3,)):
        split, _, _ = _split(f, x, split_ops=["pptest::mix"])
    assert _kinds(segments(split)) == "bgb"


def test_folding_joins_layer_ids_and_keeps_the_first_and_last_graphs() -> None:
    m = Attn((4, 5))
    x = torch.randn(6, 8)
    with attention_context(6, (4, 5)):
        split, ex, _ = _split(m, x, fold_graph_ops=100)
        assert _kinds(segments(split)) == "gbg"  # the graphs before the first and after the last break stay
        assert segments(split)[1].layer_ids == (4, 5)
        with torch.no_grad():
            _assert_same(split(*ex), (m(x),))


def test_folded_breaks_equal_eager_off_buckets() -> None:
    f = _two_mixes(2)
    compiled = torch.compile(f, backend="pp_breakable", options={
        "capture_sizes": [8, 16], "split_ops": ["pptest::mix"], "graph_mode": "emulate"})
    with torch.no_grad():
        for n in (8, 5, 11):
            x = torch.randn(n, 8)
            if n == 8:
                ppcompile.mark_token_dynamic(x)
            with ppcompile.counters.expect(replays=1):
                torch.testing.assert_close(compiled(x), f(x))
    assert _kinds(ppcompile.stage_runtimes()[-1].segments) == "gbg"


def test_every_break_kind_has_a_table_row() -> None:
    """A new ``BreakKind`` needs its row of ``BREAK_KINDS``: a description, a colour of its own, a rule."""
    assert set(BREAK_KINDS) == set(BreakKind)
    assert all(row.description and row.color.startswith("#") for row in BREAK_KINDS.values())
    assert len({row.color for row in BREAK_KINDS.values()}) == len(BREAK_KINDS)  # told apart in report.html


def test_adjacent_breaks_merge_as_their_kinds_row_says() -> None:
    """Padding-unsafe ops extend one run (one reason naming every op); split ops join it in the detail."""
    assert BREAK_KINDS[BreakKind.UNSAFE_OP].merge is RunMerge.EXTEND
    lin = torch.nn.Linear(8, 8)

    def flip_roll(x: torch.Tensor) -> torch.Tensor:
        return lin(torch.roll(torch.flip(lin(x), [0]), 1, 0))

    split, _, _ = _split(flip_roll, torch.randn(6, 8))
    assert _kinds(segments(split)) == "gbg"
    (run,) = [s.reason for s in segments(split) if s.reason]
    assert run.kind is BreakKind.UNSAFE_OP and "flip" in run.op and "roll" in run.op
    assert "joined" not in run.detail

    assert BREAK_KINDS[BreakKind.USER_SPLIT_OP].merge is RunMerge.JOIN
    split, _, _ = _split(_two_mixes(0), torch.randn(6, 8), split_ops=["pptest::mix"])
    assert _kinds(segments(split)) == "gbg"
    (joined,) = [s.reason for s in segments(split) if s.reason]
    assert joined.op == "pptest.mix"
    assert "joined with the next break (user split op: pptest.mix)" in joined.detail

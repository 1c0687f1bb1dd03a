"""Tests of ``find_token_dims``: the token symbol, input kinds and token dims on every node."""

from __future__ import annotations

import sympy
import torch
from fx_helpers import dynamo_graph, make_ctx, run_until
from torch.utils._sympy.functions import FloorDiv

from ppcompile.analysis.node_facts import SIZE_EXPR, TOKEN_DIMS, segments
from ppcompile.passes.find_token_dims import find_token_dims
from ppcompile.passes.split_at_breaks import split_at_breaks
from ppcompile.records import BreakKind, InputKind
from ppcompile.symbolic import SizeFn, example_value


class _Stage(torch.nn.Module):
    """A linear (parameters), a module buffer, a live input ``x [s0, 8]`` and a proxy dict."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("shift", torch.ones(8))

    def forward(self, x: torch.Tensor, proxies: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.lin(x) + self.shift + proxies["hidden_states"]


def _by_name(gm: torch.fx.GraphModule) -> dict[str, torch.fx.Node]:
    return {n.name: n for n in gm.graph.nodes}


def _run(fn, *args, dynamic: bool = True):  # type: ignore[no-untyped-def]
    gm, ex = dynamo_graph(fn, *args, dynamic=dynamic)
    ctx = make_ctx(gm, ex)
    result = find_token_dims(gm, ctx)
    assert result.graph_module is gm and not result.modified
    return gm, ctx


def test_token_symbol_of_a_1d_input() -> None:
    gm, ctx = _run(lambda ids: ids * 2, torch.arange(6))
    (x,) = [p for p in gm.graph.find_nodes(op="placeholder") if isinstance(example_value(p), torch.Tensor)]
    assert ctx.token_symbol is not None and not ctx.is_static
    assert TOKEN_DIMS.get(x) == ((0, ctx.token_symbol),)
    assert ctx.token_input == (list(gm.graph.find_nodes(op="placeholder")).index(x), 0)


def test_kinds_of_parameters_buffers_live_tensors_proxies_and_symints() -> None:
    gm, ctx = _run(_Stage(), torch.randn(6, 8), {"hidden_states": torch.randn(6, 8)})
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    kinds = dict(zip((p.name for p in placeholders), ctx.input_kinds))
    assert len(ctx.input_kinds) == len(placeholders)
    s0 = ctx.token_symbol
    assert isinstance(s0, sympy.Symbol)
    for name, kind in kinds.items():
        if "parameters" in name or "buffers" in name:
            assert kind is InputKind.MODULE_STATE, name
        elif name in ("l_x_", "l_proxies_hidden_states_"):
            assert kind is InputKind.TENSOR, name
        else:
            assert kind is InputKind.SYMINT, name
    assert kinds["l_self_buffers_shift_"] is InputKind.MODULE_STATE  # a buffer, not only parameters
    assert list(kinds.values()).count(InputKind.SYMINT) == 1
    (sym_index,) = ctx.symint_inputs
    assert ctx.symint_inputs[sym_index] == s0
    nodes = _by_name(gm)
    assert TOKEN_DIMS.get(nodes["l_x_"]) == ((0, s0),)
    assert TOKEN_DIMS.get(nodes["l_proxies_hidden_states_"]) == ((0, s0),)
    assert TOKEN_DIMS.get(nodes["l_self_modules_lin_parameters_weight_"]) == ()
    assert TOKEN_DIMS.get(nodes["l_self_buffers_shift_"]) == ()
    assert placeholders[ctx.token_input[0]].name == "l_x_"  # type: ignore[index]
    # Intermediates are annotated too, and the sizes are the token symbol itself.
    linear = next(n for n in gm.graph.nodes if n.target is torch._C._nn.linear)
    assert TOKEN_DIMS.get(linear) == ((0, s0),)
    assert ctx.other_symbols == frozenset()


def test_floordiv_output_gets_a_floordiv_token_expr() -> None:
    lin = torch.nn.Linear(8, 8)

    def half(x: torch.Tensor) -> torch.Tensor:
        return lin(x)[: x.shape[0] // 2] * 2

    gm, ctx = _run(half, torch.randn(7, 8))
    s0 = ctx.token_symbol
    assert s0 is not None
    (out,) = gm.graph.find_nodes(op="output")
    (result,) = out.args[0]
    ((dim, expr),) = TOKEN_DIMS.of(result)
    assert dim == 0
    assert expr == FloorDiv(s0, 2)
    assert SizeFn(expr)({s0: 7}) == 3
    assert SizeFn(expr)({s0: 8192}) == 4096
    floordiv = next(n for n in gm.graph.nodes if SIZE_EXPR.has(n) and n.op != "placeholder")
    assert SIZE_EXPR.get(floordiv) == expr


def test_static_graph_has_no_token_symbol() -> None:
    gm, ctx = _run(_Stage(), torch.randn(6, 8), {"hidden_states": torch.randn(6, 8)}, dynamic=False)
    assert ctx.token_symbol is None and ctx.token_input is None and ctx.is_static
    assert InputKind.SYMINT not in ctx.input_kinds
    assert all(not TOKEN_DIMS.has(n) for n in gm.graph.nodes)


def test_most_voted_leading_symbol_wins() -> None:
    """Two live inputs share the token count; a third has its own leading size and loses the vote."""
    lin = torch.nn.Linear(8, 8)

    def f(ids: torch.Tensor, pos: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return lin(other), ids + pos

    gm, ctx = _run(f, torch.arange(6), torch.arange(6), torch.randn(5, 8))
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    ids = next(p for p in placeholders if p.name == "l_ids_")
    other = next(p for p in placeholders if p.name == "l_other_")
    assert TOKEN_DIMS.get(ids) == ((0, ctx.token_symbol),)
    assert TOKEN_DIMS.get(other) == ()
    assert len(ctx.other_symbols) == 1


def test_batch_first_inputs_marked_one_by_one_vote_for_the_token_symbol() -> None:
    """``[1, T]`` ids and ``[1, T]`` positions marked separately get two symbols when the model never
    relates them (no rotary embedding, as in Jamba): the ids' symbol wins the tie (the first input);
    before, no token symbol was found and the stage ran eagerly at every count. A ``[1, 8]`` input of
    fixed width beside them means dim 0 may be a 1-token batch instead (a dynamic top-k width at dim
    1 is no token count): no token symbol then."""

    def stage(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return ids.float() * 2 + pos.float().mean()

    def with_width(ids: torch.Tensor, pos: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (ids.float()[..., None] * scale[:, None]).sum(-1) + pos.float().mean()

    def marked() -> tuple[torch.Tensor, torch.Tensor]:
        ids, pos = torch.ones(1, 6, dtype=torch.long), torch.arange(5)[None]
        torch._dynamo.mark_dynamic(ids, 1)
        torch._dynamo.mark_dynamic(pos, 1)
        return ids, pos

    gm, ctx = _run(stage, *marked(), dynamic=False)
    ids_node = next(n for n in gm.graph.find_nodes(op="placeholder") if "ids" in n.name)
    assert ctx.token_symbol is not None and ctx.token_input is not None and ctx.token_input[1] == 1
    assert TOKEN_DIMS.get(ids_node) == ((1, ctx.token_symbol),)
    _, ctx = _run(with_width, *marked(), torch.ones(1, 8), dynamic=False)
    assert ctx.token_symbol is None


if not hasattr(torch.ops.pptest_token_dims, "rotate"):

    @torch.library.custom_op("pptest_token_dims::rotate", mutates_args=())
    def _rotate(pos: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """An engine's rotary op: its fake relates no sizes, so Dynamo keeps the inputs' symbols apart."""
        return x * torch.cos(pos.float())[: x.shape[0], None]

    @_rotate.register_fake
    def _rotate_fake(pos: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)


def _rotary_stage(ids: torch.Tensor, pos: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = torch.ops.pptest_token_dims.rotate(pos, hidden * 2)
    return x, ids * 3, hidden.new_zeros(pos.shape[0])  # pos's size as a number: a SymInt input


def _marked(*tensors: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, ...]:
    for t in tensors:
        torch._dynamo.mark_dynamic(t, dim)
    return tensors


def _raw_symbol(node: torch.fx.Node, dim: int = 0) -> sympy.Expr:
    """The symbol Dynamo gave a dim (before any merge)."""
    return example_value(node).shape[dim].node.expr


def test_inputs_marked_one_by_one_are_one_token_count() -> None:
    """vLLM marks ``input_ids``, ``positions`` and each proxy by itself: three symbols, equal at the
    traced call, all read as the token symbol; no other symbol is left to make the rotary op a break."""
    args = _marked(torch.arange(6), torch.arange(6), torch.randn(6, 8))
    gm, ex = dynamo_graph(_rotary_stage, *args, dynamic=False)
    ctx = make_ctx(gm, ex, token_local_ops=["pptest_token_dims::rotate"])
    nodes = _by_name(gm)
    ids, pos, hidden = nodes["l_ids_"], nodes["l_pos_"], nodes["l_hidden_"]
    assert len({_raw_symbol(ids), _raw_symbol(pos), _raw_symbol(hidden)}) == 3
    find_token_dims(gm, ctx)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    first, *others = sorted((ids, pos, hidden), key=placeholders.index)  # Dynamo's order: first use
    token = ctx.token_symbol
    assert token == _raw_symbol(first) and ctx.token_input == (placeholders.index(first), 0)
    for node in (ids, pos, hidden):
        assert TOKEN_DIMS.get(node) == ((0, token),), node.name
    assert ctx.other_symbols == frozenset()
    assert {(placeholders[i].name, d, s) for i, d, s in ctx.merged_token_dims} == {
        (n.name, 0, str(_raw_symbol(n))) for n in others}
    # Dynamo passes each symbol as a number too (pos's size is read as one): all are the count.
    assert set(ctx.symint_inputs.values()) == {token}
    gm, ex = dynamo_graph(_rotary_stage, *_marked(torch.arange(6), torch.arange(6), torch.randn(6, 8)),
                          dynamic=False)
    ctx = make_ctx(gm, ex, token_local_ops=["pptest_token_dims::rotate"])
    split = run_until(gm, ctx, split_at_breaks)
    assert not any(s.reason and s.reason.kind is BreakKind.NON_TOKEN_SHAPE for s in segments(split))


def test_marked_inputs_of_other_sizes_or_dims_are_not_merged() -> None:
    """Only bare symbols of live inputs' token dims, equal at the traced call, are merged: positions of
    another length, a dim other than the token dim, and a tensor outside the call's arguments keep
    their own symbol (a non-token dynamic size)."""
    gm, ctx = _run(_rotary_stage, *_marked(torch.arange(6), torch.arange(7), torch.randn(6, 8)),
                   dynamic=False)
    pos = _by_name(gm)["l_pos_"]
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    merged = {placeholders[i].name for i, _, _ in ctx.merged_token_dims}
    assert merged in ({"l_ids_"}, {"l_hidden_"})  # ids and hidden (6) are one count; pos (7) is not
    assert TOKEN_DIMS.get(pos) == () and ctx.other_symbols == {_raw_symbol(pos)}

    def widths(ids: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return ids * 2, table.sum(1)

    ids, table = _marked(torch.arange(6))[0], _marked(torch.randn(4, 6), dim=1)[0]
    gm, ctx = _run(widths, ids, table, dynamic=False)  # [4, 6]: a width of 6, equal to the count by chance
    table_node = _by_name(gm)["l_table_"]
    assert ctx.merged_token_dims == () and TOKEN_DIMS.get(table_node) == ()
    assert _raw_symbol(table_node, 1) in ctx.other_symbols

    outside = _marked(torch.randn(6, 8))[0]  # a tensor the stage reaches outside its arguments

    def reads_outside(ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return ids * 2, outside.sum(1)

    gm, ctx = _run(reads_outside, *_marked(torch.arange(6)), dynamic=False)
    assert ctx.merged_token_dims == () and len(ctx.other_symbols) == 1


def test_batch_first_inputs_marked_one_by_one_of_one_length_are_one_token_count() -> None:
    def stage(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return ids.float() * 2 + pos.float().mean()

    gm, ctx = _run(stage, *_marked(torch.ones(1, 6, dtype=torch.long), torch.arange(6)[None], dim=1),
                   dynamic=False)
    nodes = _by_name(gm)
    assert _raw_symbol(nodes["l_ids_"], 1) != _raw_symbol(nodes["l_pos_"], 1)
    assert ctx.token_input is not None and ctx.token_input[1] == 1
    assert TOKEN_DIMS.get(nodes["l_pos_"]) == ((1, ctx.token_symbol),) and ctx.other_symbols == frozenset()
    assert [d for _, d, _ in ctx.merged_token_dims] == [1]

"""Tests of ``lift_static_inputs``: static buffers for graph-read live inputs, bridges for break outputs."""

from __future__ import annotations

import torch
from attention_modules import Attn, attention_context
from fx_helpers import bridges, dynamo_graph, make_ctx, run_until

from ppcompile.analysis.node_facts import STATIC_BUFFER, segments
from ppcompile.passes.lift_static_inputs import lift_static_inputs
from ppcompile.records import InputKind


def _lift(fn, *args, **options):  # type: ignore[no-untyped-def]
    gm, ex = dynamo_graph(fn, *args)
    ctx = make_ctx(gm, ex, **options)
    split = run_until(gm, ctx, lift_static_inputs)
    return split, ctx


def test_live_input_gets_a_buffer_at_the_cap_and_break_outputs_get_bridges() -> None:
    with attention_context(6, (4, 5)):
        split, ctx = _lift(Attn((4, 5)), torch.randn(6, 8), capture_sizes=[32, 16, 16])
    placeholders = list(split.graph.find_nodes(op="placeholder"))
    (plan,) = ctx.static_inputs
    assert placeholders[plan.input_index].name == "l_x_"
    assert ctx.input_kinds[plan.input_index] is InputKind.TENSOR
    assert plan.buffer.role == "input" and plan.buffer.name == "l_x_"
    assert plan.buffer.shape == (32, 8)  # the largest bucket
    assert plan.buffer.token_dims == (0,)
    assert plan.buffer.dtype == torch.float32 and plan.buffer.device == torch.device("cpu")
    assert plan.buffer.nbytes == 32 * 8 * 4
    assert plan.size_exprs == (ctx.token_symbol, 8)
    assert STATIC_BUFFER.get(placeholders[plan.input_index]) == plan.buffer
    # Parameters are read in place.
    for p in placeholders:
        if "parameters" in p.name:
            assert not STATIC_BUFFER.has(p)
    # Each attention output is read by the next graph segment: one bridge per break.
    breaks = [s.name for s in segments(split) if not s.is_graph]
    assert sorted(bridges(split)) == sorted(breaks)
    for name, bridge in bridges(split).items():
        assert bridge.role == "bridge" and bridge.name == name
        assert bridge.shape == (32, 2, 4) and bridge.token_dims == (0,)


def test_input_read_only_by_a_break_gets_no_buffer() -> None:
    lin = torch.nn.Linear(8, 8)

    def f(x: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        q = lin(x).view(-1, 2, 4)
        return torch.ops.ppcompile.attention(q, kv, kv, 0)  # kv goes to the break only

    with attention_context(6, [0]):
        split, ctx = _lift(f, torch.randn(6, 8), torch.randn(6, 2, 4), capture_sizes=[16])
    placeholders = list(split.graph.find_nodes(op="placeholder"))
    assert [placeholders[p.input_index].name for p in ctx.static_inputs] == ["l_x_"]
    kv = next(p for p in placeholders if p.name == "l_kv_")
    assert not STATIC_BUFFER.has(kv)
    assert bridges(split) == {}  # the attention output goes straight to the stage output


def test_proxies_are_lifted_like_inputs() -> None:
    lin = torch.nn.Linear(8, 8)

    def f(x: torch.Tensor, proxies: dict[str, torch.Tensor]) -> torch.Tensor:
        return lin(x) + proxies["residual"]

    _, ctx = _lift(f, torch.randn(6, 8), {"residual": torch.randn(6, 8)}, max_capture_tokens=64)
    assert sorted(p.buffer.name for p in ctx.static_inputs) == ["l_proxies_residual_", "l_x_"]
    assert all(p.buffer.shape == (64, 8) for p in ctx.static_inputs)


def test_non_token_input_read_by_breaks_only_is_not_lifted() -> None:
    """After ``split_at_breaks``, a ``[s1, 8]`` input is read by non-token-shape breaks only."""
    lin = torch.nn.Linear(8, 8)

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return lin(x) + lin(y).sum(0)

    split, ctx = _lift(f, torch.randn(6, 8), torch.randn(5, 8), capture_sizes=[16])
    assert [p.buffer.name for p in ctx.static_inputs] == ["l_x_"]
    assert len(bridges(split)) == 1
    for bridge in bridges(split).values():
        assert bridge.shape == (8,) and bridge.token_dims == ()  # the reduced [8] read by the add


def test_static_graph_lifts_nothing() -> None:
    gm, ex = dynamo_graph(torch.nn.Linear(8, 8), torch.randn(6, 8), dynamic=False)
    ctx = make_ctx(gm, ex)
    split = run_until(gm, ctx, lift_static_inputs)
    assert ctx.static_inputs == [] and bridges(split) == {}

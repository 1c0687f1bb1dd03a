"""Lowering's plan, read off a split graph: typed steps, copy points and buffer plans, decided once.

The stage (``Attn((0, 1))``): graph | attention break | graph | attention break | graph.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from attention_modules import Attn, attention_context
from fx_helpers import dynamo_graph, make_ctx, run_until

from ppcompile.lowering.program import build_program
from ppcompile.passes.lift_static_inputs import lift_static_inputs
from ppcompile.runtime.program import BreakStep, GraphStep, Program


def _program(traced_strides: bool = False) -> Program:
    with attention_context(6, (0, 1)):
        gm, example_inputs = dynamo_graph(Attn((0, 1)), torch.randn(6, 8))
    ctx = make_ctx(gm, example_inputs)
    split = run_until(gm, ctx, lift_static_inputs)
    compiled: dict[str, Any] = {str(n.target): getattr(split, str(n.target))
                                for n in split.graph.find_nodes(op="call_module")}
    return build_program(split, compiled, traced_strides=traced_strides, token=ctx.token_symbol)


def test_steps_are_typed_and_alternate_as_the_split() -> None:
    program = _program()
    assert [type(st) for st in program.steps] == [GraphStep, BreakStep, GraphStep, BreakStep, GraphStep]
    assert program.graph_steps == program.steps[0::2] and program.break_steps == program.steps[1::2]


def test_each_graph_output_a_break_reads_is_a_live_view() -> None:
    program = _program()
    for st in program.break_steps:
        for ref in st.args:
            producer = next((g for g in program.graph_steps if ref.slot in g.out_slots), None)
            if producer is not None:
                assert ref.slot in producer.live_views


def test_copy_points_in_order_fill_the_lifted_input_then_each_breaks_bridge() -> None:
    program = _program()
    points = program.copy_points
    (lifted,) = program.input_buffers
    assert points[0].after is None and points[0].slots == (lifted,) and points[0].kind == "copy-in"
    assert [p.index for p in points] == list(range(len(points)))
    assert [p.after for p in points[1:]] == [st.index for st in program.break_steps]
    for point, st in zip(points[1:], program.break_steps):
        assert st.copies is point and point.kind == "bridge" and point.bridges == point.slots
        assert set(point.slots) <= set(st.out_slots) and point.refreshes == ()
    assert all(p.fused == p.slots for p in points)  # one token dim each, row-major: all fusable


@pytest.mark.parametrize("traced_strides", [False, True])
def test_buffer_plans_list_inputs_then_bridges_with_the_traced_layout_only_for_compiled_segments(
    traced_strides: bool,
) -> None:
    program = _program(traced_strides)
    plans = list(program.buffers.values())
    assert [p.role for p in plans] == ["input", "bridge", "bridge"]
    assert [p.slot for p in plans] == list(program.buffers)
    assert all(p.token_dim == 0 and not p.per_bucket_strides for p in plans)
    assert all((p.layout is not None) == traced_strides for p in plans)
    assert plans[0].what.startswith("input ") and "break segment" in plans[1].what

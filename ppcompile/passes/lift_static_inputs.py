"""Pass ``lift_static_inputs``: give every non-parameter tensor a graph segment reads a static buffer.

A graph replays fixed addresses, while live inputs (``input_ids``, ``positions``, PP proxies) arrive at
fresh addresses each step, and a break segment's output is a fresh tensor each call. So each such tensor
that a graph segment reads gets one buffer sized for the largest bucket: live inputs are copied into
``buffer[:n]`` (and ``buffer[n:b]`` zeroed) before the first segment, break outputs right after their
break. Parameters and module buffers are read in place. Outputs of earlier graph segments of the same
bucket already live at fixed addresses.

Before (split graph; cap 64)::

    def forward(self, s0, L_x_, L_w_):
        submod_0 = self.submod_0(L_x_, L_w_)     # graph: reads L_x_ (live) and L_w_ (parameter)
        submod_1 = self.submod_1(submod_0)       # break
        submod_2 = self.submod_2(submod_1)       # graph: reads submod_1 (a break output)
        return (submod_2,)

After (same code; plans recorded)::

    ctx.static_inputs == [StaticInputPlan(input_index=1, buffer=StaticBuffer("L_x_", "input", (64, 64), ...))]
    L_x_.meta["pp_static_buffer"]     == the same StaticBuffer("L_x_", "input", ...)
    submod_1.meta["pp_static_buffer"] == StaticBuffer("submod_1", "bridge", (64, 64), ...)  # a bridge
    submod_0.meta["pp_written_args"] == ()   # per segment call: the arguments it writes in place
"""

from __future__ import annotations

import logging

import torch

from ppcompile.analysis.mutation import written_arguments_of
from ppcompile.analysis.node_facts import SEGMENT, STATIC_BUFFER, WRITTEN_ARGS
from ppcompile.passes.context import PassContext, PassResult, StaticInputPlan
from ppcompile.records import InputKind, StaticBuffer
from ppcompile.symbolic import SizeFn, example_value, shape_exprs

__all__ = ["lift_static_inputs"]

log = logging.getLogger(__name__)


def _reads_in_graph(node: torch.fx.Node) -> bool:
    return any(u.op == "call_module" and SEGMENT.of(u).is_graph for u in node.users)


def _buffer_for(node: torch.fx.Node, role: str, ctx: PassContext, cap: int) -> StaticBuffer:
    value = example_value(node)
    assert ctx.token_symbol is not None
    env = {ctx.token_symbol: cap}
    exprs = shape_exprs(value)
    token_dims = tuple(d for d, e in enumerate(exprs) if ctx.token_symbol in e.free_symbols)
    return StaticBuffer(
        name=node.name,
        role=role,
        shape=tuple(SizeFn(e)(env) for e in exprs),
        dtype=value.dtype,
        device=value.device,
        token_dims=token_dims,
    )


def lift_static_inputs(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Plans static buffers for graph-read live inputs (``ctx.static_inputs``) and bridges (break outputs
    graph segments read); records each on its node (``STATIC_BUFFER``), and on each segment call which
    of its arguments the segment writes in place (``WRITTEN_ARGS``), where lowering reads them."""
    for node in gm.graph.find_nodes(op="call_module"):
        WRITTEN_ARGS.set(node, written_arguments_of(getattr(gm, str(node.target))))
    if ctx.is_static:
        return PassResult(gm, modified=False)
    cap = ctx.config.cap
    ctx.static_inputs = []
    for i, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        if ctx.input_kinds[i] is InputKind.TENSOR and _reads_in_graph(node):
            buffer = _buffer_for(node, "input", ctx, cap)
            STATIC_BUFFER.set(node, buffer)
            ctx.static_inputs.append(StaticInputPlan(i, buffer, shape_exprs(example_value(node))))
    bridges: list[StaticBuffer] = []
    for node in gm.graph.nodes:
        producer = node.args[0] if node.op == "call_function" and node.args else node
        if not isinstance(producer, torch.fx.Node) or producer.op != "call_module":
            continue
        if SEGMENT.of(producer).is_graph or not isinstance(example_value(node), torch.Tensor):
            continue
        if _reads_in_graph(node):
            buffer = _buffer_for(node, "bridge", ctx, cap)
            STATIC_BUFFER.set(node, buffer)
            bridges.append(buffer)
    total = sum(p.buffer.nbytes for p in ctx.static_inputs) + sum(b.nbytes for b in bridges)
    log.debug("%s: %d lifted inputs, %d bridges, %.1f KiB at bucket %d", ctx.graph_name,
              len(ctx.static_inputs), len(bridges), total / 1024, cap)
    return PassResult(gm, modified=False)

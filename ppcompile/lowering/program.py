"""Lowering the split stage graph into a flat ``Program`` (``runtime/program.py``'s data types).

Each value of the split graph (an input, a segment output) gets a slot. A step names the segment's
callable, where each argument comes from (a slot, or a size expression), and which slots its outputs
fill; graph steps also say which outputs breaks or callers read at the live size, break steps which
outputs graphs read through static bridges.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import torch

from ppcompile.analysis.token_locality import mutated_inputs
from ppcompile.records import Segment
from ppcompile.runtime.program import Program, Ref, SegmentFn, Step, TensorLayout
from ppcompile.symbolic import SizeFn, example_value, size_expr

__all__ = ["build_program"]


def _unwrap_single(fn: Callable[..., Any]) -> SegmentFn:
    def call(*args: Any) -> tuple[Any, ...]:
        return (fn(*args),)

    return call


def _output_values(out: torch.fx.Node, multi: bool) -> list[Any]:
    values = out.args[0] if multi else (out.args[0],)
    return [example_value(v) if isinstance(v, torch.fx.Node) else v for v in values]  # type: ignore[union-attr]


def _output_sizes(out: torch.fx.Node, multi: bool) -> tuple[tuple[SizeFn, ...] | SizeFn | None, ...]:
    sizes: list[tuple[SizeFn, ...] | SizeFn | None] = []
    for ev in _output_values(out, multi):
        if isinstance(ev, torch.Tensor):
            sizes.append(tuple(SizeFn(size_expr(d)) for d in ev.shape))
        elif isinstance(ev, (int, torch.SymInt)) and not isinstance(ev, bool):
            sizes.append(SizeFn(size_expr(ev)))
        else:
            sizes.append(None)
    return tuple(sizes)


def _output_layouts(out: torch.fx.Node, multi: bool) -> tuple[TensorLayout | None, ...]:
    values = _output_values(out, multi)
    return tuple(TensorLayout.of(ev) if isinstance(ev, torch.Tensor) else None for ev in values)


def _written_args(submod: torch.fx.GraphModule) -> set[int]:
    """Positions of ``submod``'s inputs that its ops write in place (through views)."""
    placeholders = list(submod.graph.find_nodes(op="placeholder"))
    written = {p for node in submod.graph.nodes if node.op in ("call_function", "call_method")
               for p in mutated_inputs(node)}
    return {i for i, p in enumerate(placeholders) if p in written}


def build_program(split: torch.fx.GraphModule, compiled: dict[str, Callable[..., Any]]) -> Program:
    """Flattens ``split`` (after the passes) into a ``Program``; ``compiled`` maps submodule names to
    their compiled callables."""
    slots: dict[torch.fx.Node, int] = {}
    placeholders = list(split.graph.find_nodes(op="placeholder"))
    for i, p in enumerate(placeholders):
        slots[p] = i
    token_dims: dict[int, tuple[tuple[int, SizeFn], ...]] = {}

    def slot_of(node: torch.fx.Node) -> int:
        if node not in slots:
            slots[node] = len(slots)
        dims = node.meta.get("pp_token_dims")
        if dims:
            token_dims[slots[node]] = tuple((d, SizeFn(e)) for d, e in dims)
        return slots[node]

    def ref(node: Any) -> Ref:
        expr = node.meta.get("pp_size_expr") if isinstance(node, torch.fx.Node) else None
        if expr is not None:
            return Ref(size=SizeFn(expr))
        return Ref(slot=slot_of(node))

    for p in placeholders:
        slot_of(p)
    steps: list[Step] = []
    for node in split.graph.find_nodes(op="call_module"):
        segment: Segment = node.meta["pp_segment"]
        (out,) = getattr(split, str(node.target)).graph.find_nodes(op="output")
        multi = isinstance(out.args[0], (tuple, list))
        if multi:
            out_slots = [-1] * len(out.args[0])
            for user in node.users:
                if user.op == "call_function" and user.target is operator.getitem:
                    out_slots[user.args[1]] = slot_of(user)
        else:
            out_slots = [slot_of(node)]
        fn = compiled[str(node.target)]
        steps.append(Step(
            index=len(steps),
            segment=segment,
            fn=fn if multi else _unwrap_single(fn),
            args=tuple(ref(a) for a in node.args),
            out_slots=tuple(out_slots),
            writes=tuple((i, s) for i, s in enumerate(out_slots) if s >= 0),
            out_sizes=_output_sizes(out, multi),
            out_layouts=_output_layouts(out, multi),
            call=fn,
            single_output=not multi,
        ))

    (output,) = split.graph.find_nodes(op="output")
    results = output.args[0]
    outputs = tuple(ref(r) if isinstance(r, torch.fx.Node) else r for r in results)

    node_of = {s: n for n, s in slots.items()}
    graph_reads = {a.slot for st in steps if st.segment.is_graph for a in st.args if a.slot >= 0}
    live_reads = {a.slot for st in steps if not st.segment.is_graph for a in st.args if a.slot >= 0}
    live_reads |= {r.slot for r in outputs if isinstance(r, Ref) and r.slot >= 0}
    graph_outputs = {s for st in steps if st.segment.is_graph for s in st.out_slots if s >= 0}
    bridge_buffers = {slots[n]: n.meta["pp_static_buffer"] for n in slots
                      if n.op != "placeholder" and "pp_static_buffer" in n.meta}
    input_buffers = {
        slots[n]: n.meta["pp_static_buffer"] for n in placeholders if "pp_static_buffer" in n.meta
    }
    buffered = input_buffers.keys() | bridge_buffers.keys()
    finished = []
    for st in steps:
        written = [st.args[i].slot for i in sorted(_written_args(getattr(split, st.segment.name)))]
        if st.segment.is_graph:
            read = [s for s in st.out_slots if s in live_reads]
            tensors = tuple(s for s in read if isinstance(example_value(node_of[s]), torch.Tensor))
            numbers = tuple(s for s in read if s not in tensors)
            finished.append(dataclasses.replace(
                st, live_views=tensors, live_values=numbers,
                writes_buffers=tuple(s for s in written if s in buffered)))
        else:
            bridges = tuple(s for s in st.out_slots if s in graph_reads)
            read_later = {a.slot for later in steps[st.index + 1:] if later.segment.is_graph
                          for a in later.args}
            finished.append(dataclasses.replace(
                st, bridges=bridges, in_place=tuple(s for s in written if s in graph_outputs),
                refreshes=tuple(s for s in written if s in read_later and s in buffered)))
    return Program(
        num_slots=len(slots),
        num_inputs=len(placeholders),
        steps=tuple(finished),
        outputs=outputs,
        token_dims=token_dims,
        bridge_buffers=bridge_buffers,
        input_buffers=input_buffers,
        input_layouts={slots[p]: (p.name, TensorLayout.of(ev)) for p in placeholders
                       if isinstance(ev := example_value(p), torch.Tensor)},
    )

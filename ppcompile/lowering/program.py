"""Lowering the split stage graph into a flat ``Program`` (``runtime/program.py``'s data types).

Each value of the split graph (an input, a segment output) gets a slot. A step names the segment's
callable, where each argument comes from (a slot, or a size expression), and which slots its outputs
fill. Everything the runtime and the reports need about the data path is decided here, once: which
graph outputs breaks or callers read at the live size (``GraphStep.live_views``), which static values a
graph writes in place, each static buffer's plan (``BufferPlan``: role, traced layout, bucket views),
and each copy point (``CopyPoint``: the buffers it fills after which break, which of them are fused).
Bridges that are never live at once share a buffer (``bridge_memory.py``).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy
import torch

from ppcompile.analysis import node_facts
from ppcompile.lowering.bridge_memory import share_bridge_memory
from ppcompile.records import Segment
from ppcompile.runtime.program import (
    BreakStep,
    CopyPoint,
    GraphStep,
    OutputRing,
    Program,
    Ref,
    SegmentFn,
    Step,
)
from ppcompile.runtime.static_buffers import BufferPlan, TensorLayout, follows_token_count
from ppcompile.symbolic import SizeFn, example_value, size_expr

__all__ = ["SingleOutput", "build_program"]


class SingleOutput:
    """A one-output segment's callable, returning its output in a 1-tuple as every step's ``fn`` does
    (a class, not a closure: a stored stage pickles it)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        return (self.fn(*args),)


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


@dataclasses.dataclass(frozen=True)
class _Traced:
    """A step as read off the split graph, before lowering knows what later steps read."""

    index: int
    segment: Segment
    fn: SegmentFn
    args: tuple[Ref, ...]
    out_slots: tuple[int, ...]
    out_sizes: tuple[tuple[SizeFn, ...] | SizeFn | None, ...]
    out_layouts: tuple[TensorLayout | None, ...]
    call: Callable[..., Any]
    single_output: bool
    written: tuple[int, ...]  # slots of the arguments the segment writes in place

    def common(self) -> dict[str, Any]:
        """The fields every ``Step`` has."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "written"}


def _copy_point(index: int, after: int | None, slots: tuple[int, ...], refreshes: tuple[int, ...],
                buffers: Mapping[int, BufferPlan]) -> CopyPoint:
    return CopyPoint(index, after, slots, tuple(s for s in slots if buffers[s].fusable), refreshes)


def _buffer_plans(slots: Mapping[torch.fx.Node, int], steps: Sequence[_Traced],
                  token_dims: Mapping[int, tuple[tuple[int, SizeFn], ...]], traced_strides: bool,
                  token: sympy.Symbol | None) -> dict[int, BufferPlan]:
    """A plan per static buffer, inputs first (in input order), then bridges (in step order)."""
    what: dict[int, str] = {}
    traced: dict[int, TensorLayout | None] = {}
    for node, slot in slots.items():
        if node.op == "placeholder":
            what[slot] = f"input {node.name!r}"
            value = example_value(node)
            traced[slot] = TensorLayout.of(value) if isinstance(value, torch.Tensor) else None
    for st in steps:
        for i, s in enumerate(st.out_slots):
            if s >= 0 and not st.segment.is_graph:
                what[s] = f"the output {i} of break segment {st.segment.name}"
                traced[s] = st.out_layouts[i] if i < len(st.out_layouts) else None
    plans: dict[int, BufferPlan] = {}
    for node, slot in sorted(slots.items(), key=lambda kv: (kv[0].op != "placeholder", kv[1])):
        spec = node_facts.STATIC_BUFFER.get(node)
        if spec is None:
            continue
        layout = traced.get(slot) if traced_strides else None
        plans[slot] = BufferPlan(slot, spec, what.get(slot, f"slot {slot}"), tuple(token_dims.get(slot, ())),
                                 layout, layout is not None and follows_token_count(layout, token))
    return plans


def _output_ring(outputs: Sequence[Any], steps: Sequence[Step], depth: int,
                 input_layouts: Mapping[int, tuple[str, TensorLayout]]) -> OutputRing | None:
    """The ring of ``depth`` slots for the outputs that live in static memory, if any and ``depth`` > 1:
    graph outputs read at the live size, and static values a graph wrote in place (an input among them,
    laid out as traced)."""
    static = {s for st in steps if isinstance(st, GraphStep) for s in (*st.live_views, *st.writes_buffers)}
    layouts = {s: layout for s, (_, layout) in input_layouts.items()}
    for st in steps:
        for i, s in st.writes:
            layout = st.out_layouts[i] if i < len(st.out_layouts) else None
            if layout is not None:
                layouts[s] = layout
    slots = tuple(dict.fromkeys(r.slot for r in outputs if isinstance(r, Ref) and r.slot in static))
    if depth < 2 or not slots:
        return None
    return OutputRing(depth, slots, tuple(layouts[s] for s in slots))


def build_program(split: torch.fx.GraphModule, compiled: dict[str, Callable[..., Any]], *,
                  traced_strides: bool = False, token: sympy.Symbol | None = None,
                  output_slots: int = 1) -> Program:
    """Flattens ``split`` (after the passes) into a ``Program``; ``compiled`` maps submodule names to
    their compiled callables. ``traced_strides``: graph segments were compiled for their inputs' traced
    strides, so static buffers take them (``token``: the token symbol, for strides that follow it).
    ``output_slots`` > 1: outputs in static memory are copied into a ring of that many slots."""
    slots: dict[torch.fx.Node, int] = {}
    placeholders = list(split.graph.find_nodes(op="placeholder"))
    for i, p in enumerate(placeholders):
        slots[p] = i
    token_dims: dict[int, tuple[tuple[int, SizeFn], ...]] = {}

    def slot_of(node: torch.fx.Node) -> int:
        if node not in slots:
            slots[node] = len(slots)
        dims = node_facts.TOKEN_DIMS.get(node)
        if dims:
            token_dims[slots[node]] = tuple((d, SizeFn(e)) for d, e in dims)
        return slots[node]

    def ref(node: Any) -> Ref:
        expr = node_facts.SIZE_EXPR.get(node) if isinstance(node, torch.fx.Node) else None
        if expr is not None:
            return Ref(size=SizeFn(expr))
        return Ref(slot=slot_of(node))

    for p in placeholders:
        slot_of(p)
    traced: list[_Traced] = []
    for node in split.graph.find_nodes(op="call_module"):
        segment = node_facts.SEGMENT.of(node)
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
        args = tuple(ref(a) for a in node.args)
        traced.append(_Traced(
            index=len(traced), segment=segment, fn=fn if multi else SingleOutput(fn), args=args,
            out_slots=tuple(out_slots), out_sizes=_output_sizes(out, multi),
            out_layouts=_output_layouts(out, multi), call=fn, single_output=not multi,
            written=tuple(args[i].slot for i in node_facts.WRITTEN_ARGS.get(node) or ()),
        ))

    (output,) = split.graph.find_nodes(op="output")
    outputs = tuple(ref(r) if isinstance(r, torch.fx.Node) else r for r in output.args[0])
    buffers = _buffer_plans(slots, traced, token_dims, traced_strides, token)
    node_of = {s: n for n, s in slots.items()}
    graph_reads = {a.slot for st in traced if st.segment.is_graph for a in st.args if a.slot >= 0}
    live_reads = {a.slot for st in traced if not st.segment.is_graph for a in st.args if a.slot >= 0}
    live_reads |= {r.slot for r in outputs if isinstance(r, Ref) and r.slot >= 0}
    graph_outputs = {s for st in traced if st.segment.is_graph for s in st.out_slots if s >= 0}
    copy_in = _copy_point(0, None, tuple(s for s in buffers if s < len(placeholders)), (), buffers)
    points = 1
    steps: list[Step] = []
    for st in traced:
        common = st.common()
        written = [s for s in st.written if s >= 0]
        if st.segment.is_graph:
            read = [s for s in st.out_slots if s in live_reads]
            tensors = tuple(s for s in read if isinstance(example_value(node_of[s]), torch.Tensor))
            steps.append(GraphStep(
                **common, live_views=tensors, live_values=tuple(s for s in read if s not in tensors),
                writes_buffers=tuple(s for s in written if s in buffers)))
            continue
        read_later = {a.slot for later in traced[st.index + 1:] if later.segment.is_graph for a in later.args}
        # Unbuffered graph reads only happen in a stage that never graphs (concrete sizes: nothing lifted).
        bridges = tuple(s for s in st.out_slots if s in graph_reads and s in buffers)
        refreshes = tuple(s for s in written if s in read_later and s in buffers)
        copies = None
        if bridges or refreshes:
            copies = _copy_point(points, st.index, (*bridges, *refreshes), refreshes, buffers)
            points += 1
        steps.append(BreakStep(**common, in_place=tuple(s for s in written if s in graph_outputs),
                               copies=copies))
    return Program(
        num_slots=len(slots),
        num_inputs=len(placeholders),
        steps=tuple(steps),
        outputs=outputs,
        token_dims=token_dims,
        buffers=share_bridge_memory(buffers, steps),
        copy_in=copy_in,
        input_layouts=(input_layouts := {slots[p]: (p.name, TensorLayout.of(ev)) for p in placeholders
                                         if isinstance(ev := example_value(p), torch.Tensor)}),
        output_ring=_output_ring(outputs, steps, output_slots, input_layouts),
    )

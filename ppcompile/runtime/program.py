"""The stage as a flat program: value slots and segment steps, built once from the split graph.

Each value of the split graph (an input, a segment output) gets a slot. A step names the segment's
callable, where each argument comes from (a slot, or a size expression), and which slots its outputs
fill. The runtime's generated code (``codegen.py``) makes those calls with two kinds of values: *static*
(bucket-sized tensors that graphs read and write, a table per bucket) and *live* (tensors of the live
token count that break segments and callers see, locals).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy
import torch

from ppcompile.passes.context import PassContext
from ppcompile.records import Segment, StaticBuffer
from ppcompile.symbolic import SizeFn, example_value, size_expr

__all__ = ["Program", "Ref", "Step", "TensorLayout", "build_program", "strides_match"]

SegmentFn = Callable[..., Sequence[Any]]


@dataclasses.dataclass(frozen=True)
class Ref:
    """Where an argument comes from: a slot, or a size evaluated for the bucket or live count."""

    slot: int = -1
    size: SizeFn | None = None


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """A traced tensor's layout: size and stride per dim (expressions of the symbols), dtype, device."""

    sizes: tuple[SizeFn, ...]
    strides: tuple[SizeFn, ...]
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def of(value: torch.Tensor) -> TensorLayout:
        return TensorLayout(tuple(SizeFn(size_expr(d)) for d in value.shape),
                            tuple(SizeFn(size_expr(d)) for d in value.stride()), value.dtype, value.device)

    def at(self, env: Mapping[sympy.Symbol, int]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """(shape, strides) for ``env``, or None when one names a symbol ``env`` does not bind."""
        try:
            return tuple(f(env) for f in self.sizes), tuple(f(env) for f in self.strides)
        except (KeyError, TypeError, ValueError):
            return None


def strides_match(actual: Sequence[int], expected: Sequence[int], shape: Sequence[int]) -> bool:
    """Whether ``actual`` strides address a ``shape`` tensor as ``expected`` do: strides of dims of size
    0 or 1 address no other element, so they may differ (as in Inductor's own stride asserts)."""
    return all(a == e or n < 2 for a, e, n in zip(actual, expected, shape))


@dataclasses.dataclass(frozen=True)
class Step:
    index: int
    segment: Segment
    fn: SegmentFn  # returns a sequence of outputs, also for a one-output segment
    args: tuple[Ref, ...]
    out_slots: tuple[int, ...]  # -1 for an output nobody reads as a tensor
    live_views: tuple[int, ...] = ()  # graph tensor outputs that breaks or callers read at live size
    live_values: tuple[int, ...] = ()  # graph non-tensor outputs (numbers) that breaks or callers read
    bridges: tuple[int, ...] = ()  # break outputs that graphs read through a static bridge
    # (output index, slot) for the outputs someone reads.
    writes: tuple[tuple[int, int], ...] = ()
    # Per output, from the traced values: a tensor's size per dim, a number's value, or None.
    out_sizes: tuple[tuple[SizeFn, ...] | SizeFn | None, ...] = ()
    # Per output, a tensor's traced layout (else None): what graph segments were compiled to read.
    out_layouts: tuple[TensorLayout | None, ...] = ()
    # The segment's callable as compiled: returns its one output bare when ``single_output``.
    call: Callable[..., Any] | None = None
    single_output: bool = False

    def output_strides(self, env: Mapping[sympy.Symbol, int]) -> list[tuple[int, ...] | None]:
        """Each tensor output's traced strides for ``env`` (None for a number, or if unknown)."""
        at = [None if layout is None else layout.at(env) for layout in self.out_layouts]
        return [None if shape_strides is None else shape_strides[1] for shape_strides in at]

    def output_shapes(self, env: Mapping[sympy.Symbol, int]) -> list[tuple[int, ...] | int | None]:
        """What each output is for ``env``: a tensor's shape, a number's value, None if unknown."""
        shapes: list[tuple[int, ...] | int | None] = []
        for sizes in self.out_sizes:
            try:
                if isinstance(sizes, tuple):
                    shapes.append(tuple(size(env) for size in sizes))
                else:
                    shapes.append(None if sizes is None else sizes(env))
            except (KeyError, TypeError, ValueError):  # a symbol the env does not bind
                shapes.append(None)
        return shapes


@dataclasses.dataclass(frozen=True)
class Program:
    num_slots: int
    num_inputs: int
    steps: tuple[Step, ...]
    outputs: tuple[Ref | Any, ...]  # a Ref, or a constant returned as is
    token_dims: dict[int, tuple[tuple[int, SizeFn], ...]]  # slot -> (dim, live size) to narrow
    bridge_buffers: dict[int, StaticBuffer]
    input_buffers: dict[int, StaticBuffer]
    # Tensor inputs: slot -> (placeholder name, traced layout).
    input_layouts: dict[int, tuple[str, TensorLayout]] = dataclasses.field(default_factory=dict)


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


def build_program(
    split: torch.fx.GraphModule, ctx: PassContext, compiled: dict[str, Callable[..., Any]]
) -> Program:
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
    finished = []
    for st in steps:
        if st.segment.is_graph:
            read = [s for s in st.out_slots if s in live_reads]
            tensors = tuple(s for s in read if isinstance(example_value(node_of[s]), torch.Tensor))
            numbers = tuple(s for s in read if s not in tensors)
            finished.append(dataclasses.replace(st, live_views=tensors, live_values=numbers))
        else:
            bridges = tuple(s for s in st.out_slots if s in graph_reads)
            finished.append(dataclasses.replace(st, bridges=bridges))
    bridge_buffers = {slots[n]: n.meta["pp_static_buffer"] for n in slots
                      if n.op != "placeholder" and "pp_static_buffer" in n.meta}
    input_buffers = {
        slots[n]: n.meta["pp_static_buffer"] for n in placeholders if "pp_static_buffer" in n.meta
    }
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

"""The stage as a flat program: value slots, typed steps, copy points and static buffers (built by
``lowering.build_program``, read by everything that executes or describes a stage).

Each value of the split graph (an input, a segment output) gets a slot. A :class:`GraphStep` replays a
graph segment on static values; a :class:`BreakStep` runs a break segment eagerly on live values and may
own a :class:`CopyPoint` that fills static buffers after it. The runtime's generated code
(``codegen.py``) makes the calls with two kinds of values: *static* (bucket-sized tensors that graphs
read and write, a table per bucket) and *live* (tensors of the live token count that break segments and
callers see, locals). Readers iterate the plan; none re-derives a copy point, a layout or a step fact.

Program of a two-layer stage (slot numbers; ``h`` hidden states, ``r`` residual)::

    buffers      slot 0  input  h            slot 1  input  r        slot 5  bridge  attn out
    copy point 0 (copy-in, before step 0): slots 0, 1   (fused: 0, 1)
    step 0  GraphStep  submod_0(slot 0, slot 1, size s0) -> slots 3, 4    live views: 3
    step 1  BreakStep  submod_1(slot 3)                  -> slot 5        copy point 1: slot 5
    step 2  GraphStep  submod_2(slot 5, slot 4, slot 2)  -> slot 6        live views: 6
    outputs: slot 6, size s0
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Literal

import sympy

from ppcompile.records import Segment, StaticBuffer
from ppcompile.runtime.static_buffers import BufferPlan, TensorLayout
from ppcompile.symbolic import SizeFn

__all__ = ["BreakStep", "CopyPoint", "GraphStep", "OutputRing", "Program", "Ref", "SegmentFn", "Step"]

SegmentFn = Callable[..., Sequence[Any]]


@dataclasses.dataclass(frozen=True)
class Ref:
    """Where an argument comes from: a slot, or a size evaluated for the bucket or live count."""

    slot: int = -1
    size: SizeFn | None = None


@dataclasses.dataclass(frozen=True)
class CopyPoint:
    """Where the graph path fills static buffers from live values: the live inputs before the first
    step, or a break's outputs that graphs read (its bridges) and the static values it wrote in place
    (its refreshes), after it. ``copiers[index]`` of a stage instance is the fused copier bound to it."""

    index: int  # position in ``Program.copy_points``
    after: int | None  # the break step it follows; None: the live inputs, before any step
    slots: tuple[int, ...]  # the static buffers it fills, in order
    fused: tuple[int, ...] = ()  # of ``slots``, those one fused copier fills (``BufferPlan.fusable``)
    refreshes: tuple[int, ...] = ()  # of ``slots``, static values the break wrote in place

    @property
    def kind(self) -> Literal["copy-in", "bridge"]:
        """``"copy-in"`` (live inputs) or ``"bridge"`` (after a break), as instrumentation names it."""
        return "copy-in" if self.after is None else "bridge"

    @property
    def bridges(self) -> tuple[int, ...]:
        return tuple(s for s in self.slots if s not in self.refreshes)


@dataclasses.dataclass(frozen=True)
class _Step:
    """What every step has: its segment, its callable, its arguments and outputs."""

    index: int
    segment: Segment
    fn: SegmentFn  # returns a sequence of outputs, also for a one-output segment
    args: tuple[Ref, ...]
    out_slots: tuple[int, ...]  # -1 for an output nobody reads as a tensor
    # Per output, from the traced values: a tensor's size per dim, a number's value, or None.
    out_sizes: tuple[tuple[SizeFn, ...] | SizeFn | None, ...] = ()
    # Per output, a tensor's traced layout (else None): what graph segments were compiled to read.
    out_layouts: tuple[TensorLayout | None, ...] = ()
    # The segment's callable as compiled: returns its one output bare when ``single_output``.
    call: Callable[..., Any] | None = None
    single_output: bool = False

    @property
    def writes(self) -> tuple[tuple[int, int], ...]:
        """(output index, slot) for the outputs someone reads."""
        return tuple((i, s) for i, s in enumerate(self.out_slots) if s >= 0)

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
class GraphStep(_Step):
    """A graph segment: replayed per bucket on static values."""

    is_graph: ClassVar[bool] = True
    live_views: tuple[int, ...] = ()  # tensor outputs that breaks or callers read at the live size
    live_values: tuple[int, ...] = ()  # non-tensor outputs (numbers) that breaks or callers read
    # Static values (lifted inputs, bridged break outputs) this graph writes in place, in their buffers.
    # Breaks and outputs after it read the buffer's live view instead of the live tensor, and a written
    # input is copied back into the caller's tensor at the end of the call.
    writes_buffers: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class BreakStep(_Step):
    """A break segment: run eagerly on live values."""

    is_graph: ClassVar[bool] = False
    # Graph outputs this break writes in place (an out-variant op's ``out``): later graphs read the
    # written static memory itself, so they need no bridge.
    in_place: tuple[int, ...] = ()
    copies: CopyPoint | None = None  # the static buffers filled after it, if any

    @property
    def bridges(self) -> tuple[int, ...]:
        """Its outputs that graphs read, copied into static bridges after it."""
        return () if self.copies is None else self.copies.bridges

    @property
    def refreshes(self) -> tuple[int, ...]:
        """Static values it writes in place that later graphs read (an op updating ``residual`` in
        place): it writes the live tensor, so they are copied into their buffers again after it."""
        return () if self.copies is None else self.copies.refreshes


Step = GraphStep | BreakStep


@dataclasses.dataclass(frozen=True)
class OutputRing:
    """Outputs that stay valid for ``depth`` forwards (option ``output_slots``): after the last step, each
    output that lives in static memory (a graph's live view, or a static value a graph wrote in place)
    is copied into this call's slot of its ring, ``i mod depth`` for forward ``i``, and the call returns
    views of that slot. ``layouts``: each copied output's traced layout (its ring buffers take the shape
    at the largest bucket)."""

    depth: int
    slots: tuple[int, ...]  # output slots copied, in order; ``ring[j]`` holds ``slots[j]``
    layouts: tuple[TensorLayout, ...]


@dataclasses.dataclass(frozen=True)
class Program:
    """The flat program of one stage graph (read-only)."""

    num_slots: int
    num_inputs: int
    steps: tuple[Step, ...]
    outputs: tuple[Ref | Any, ...]  # a Ref, or a constant returned as is
    token_dims: Mapping[int, tuple[tuple[int, SizeFn], ...]]  # slot -> (dim, live size) to narrow
    buffers: Mapping[int, BufferPlan] = dataclasses.field(default_factory=dict)  # slot -> its buffer
    copy_in: CopyPoint = dataclasses.field(default_factory=lambda: CopyPoint(0, None, ()))
    # Tensor inputs: slot -> (placeholder name, traced layout).
    input_layouts: Mapping[int, tuple[str, TensorLayout]] = dataclasses.field(default_factory=dict)
    output_ring: OutputRing | None = None  # outputs copied into a ring of slots (``output_slots`` > 1)

    @property
    def copy_points(self) -> tuple[CopyPoint, ...]:
        """Every copy point in execution order: the copy-in, then each break's (``CopyPoint.index``)."""
        return (self.copy_in, *(st.copies for st in self.break_steps if st.copies is not None))

    @property
    def graph_steps(self) -> tuple[GraphStep, ...]:
        return tuple(st for st in self.steps if isinstance(st, GraphStep))

    @property
    def break_steps(self) -> tuple[BreakStep, ...]:
        return tuple(st for st in self.steps if isinstance(st, BreakStep))

    @property
    def input_buffers(self) -> Mapping[int, StaticBuffer]:
        """Static input buffers' specs by input slot."""
        return types.MappingProxyType({s: p.spec for s, p in self.buffers.items() if p.role == "input"})

    @property
    def bridge_buffers(self) -> Mapping[int, StaticBuffer]:
        """Static bridges' specs by slot (break outputs that graphs read)."""
        return types.MappingProxyType({s: p.spec for s, p in self.buffers.items() if p.role == "bridge"})

    @property
    def written_inputs(self) -> tuple[int, ...]:
        """Input slots a graph writes in place: copied back into the caller's tensor after the call."""
        return tuple(dict.fromkeys(s for st in self.graph_steps for s in st.writes_buffers
                                   if s < self.num_inputs))

    def producer(self, slot: int) -> str:
        """``segment[i]``: the segment output held in ``slot`` (``slot k`` for an input)."""
        for st in self.steps:
            for i, s in st.writes:
                if s == slot:
                    return f"{st.segment.name}[{i}]"
        return f"slot {slot}"

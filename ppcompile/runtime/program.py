"""The stage as a flat program: value slots and segment steps (built by ``lowering.build_program``).

Each value of the split graph (an input, a segment output) gets a slot. A step names the segment's
callable, where each argument comes from (a slot, or a size expression), and which slots its outputs
fill. The runtime's generated code (``codegen.py``) makes those calls with two kinds of values: *static*
(bucket-sized tensors that graphs read and write, a table per bucket) and *live* (tensors of the live
token count that break segments and callers see, locals).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy
import torch

from ppcompile.records import Segment, StaticBuffer
from ppcompile.symbolic import SizeFn, size_expr

__all__ = ["Program", "Ref", "SegmentFn", "Step", "TensorLayout", "strides_match"]

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
    # Graph outputs this break writes in place (an out-variant op's ``out``): later graphs read the
    # written static memory itself, so they need no bridge.
    in_place: tuple[int, ...] = ()
    # Static values (lifted inputs, bridged break outputs) this break writes in place that later graphs
    # read (an op updating ``residual`` in place): it writes the live tensor, so they are copied into
    # their static buffers again after it.
    refreshes: tuple[int, ...] = ()
    # Graph steps: static values (lifted inputs, bridged break outputs) this graph writes in place, in
    # their buffers. Breaks and outputs after it read the buffer's live view instead of the live tensor,
    # and a written input is copied back into the caller's tensor at the end of the call.
    writes_buffers: tuple[int, ...] = ()
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

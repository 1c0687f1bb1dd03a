"""Static bridges whose live ranges do not overlap share one buffer.

A bridge holds a break's output for the graph segments after it that read it. It is written after its
break and last read by its last reading graph; steps run in order, on one stream. A dense stage has one
bridge per layer (the attention output), each at the largest bucket, but only one of them holds a value
at any time: layer 5's is written after the last read of layer 4's. So bridges of one layout take turns
in one buffer, allocated and zeroed once, in place of one per layer::

    step 1 break submod_1 -> bridge s36   (read by step 2)
    step 3 break submod_3 -> bridge s41   (read by step 4)
    step 5 break submod_5 -> bridge s46   (read by step 6)

    before: three buffers [8192, 4, 16]
    after:  s36 owns one; s41 and s46 reuse it (``BufferPlan.shares_with == 36``)

A bridge keeps a buffer of its own when something reads its buffer other than the graphs that read the
bridge: a graph writes it in place (breaks and outputs after it then read the buffer). A bridge of a
non-float dtype keeps its own too: capture runs graphs on whatever a buffer holds (zeros, or what an
earlier call wrote), and where another bridge's float is as good as any, its index may be out of range
for this one's readers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence

from ppcompile.runtime.program import BreakStep, GraphStep, Step
from ppcompile.runtime.static_buffers import BufferPlan

__all__ = ["share_bridge_memory"]


def _layout_key(plan: BufferPlan) -> Hashable:
    """Bridges with equal keys can use each other's buffer: same allocation, same bucket views."""
    spec = plan.spec
    return (spec.shape, spec.dtype, spec.device, spec.token_dims, plan.token_dims, plan.layout,
            plan.per_bucket_strides)


def _live_ranges(buffers: Mapping[int, BufferPlan], steps: Sequence[Step]) -> dict[int, tuple[int, int]]:
    """(first write, last use) by step index for each bridge that may share its buffer."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    written_by_graphs: set[int] = set()
    for st in steps:
        if isinstance(st, BreakStep) and st.copies is not None:
            for s in st.copies.slots:
                first.setdefault(s, st.index)
                last[s] = st.index
        elif isinstance(st, GraphStep):
            written_by_graphs.update(st.writes_buffers)
            for r in st.args:
                if r.size is None and r.slot in first:
                    last[r.slot] = st.index
    return {s: (first[s], last[s]) for s, plan in buffers.items()
            if plan.role == "bridge" and plan.spec.dtype.is_floating_point and s in first
            and s not in written_by_graphs}


def share_bridge_memory(buffers: Mapping[int, BufferPlan], steps: Sequence[Step]) -> dict[int, BufferPlan]:
    """``buffers`` with ``shares_with`` set on each bridge that reuses the buffer of an earlier one of
    the same layout whose live range ended before it is written (first fit, in order of writes)."""
    ranges = _live_ranges(buffers, steps)
    # Per layout, each shared buffer: the slot that owns it and the last step that uses it so far.
    owners: dict[Hashable, list[list[int]]] = {}
    out = dict(buffers)
    for slot in sorted(ranges, key=lambda s: ranges[s]):
        start, end = ranges[slot]
        held = owners.setdefault(_layout_key(buffers[slot]), [])
        free = next((h for h in held if h[1] < start), None)
        if free is None:
            held.append([slot, end])
            continue
        out[slot] = dataclasses.replace(buffers[slot], shares_with=free[0])
        free[1] = end
    return out

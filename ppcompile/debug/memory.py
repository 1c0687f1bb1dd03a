"""The memory section of the stage report: what a stage's graphs hold, estimated from traced segments.

:func:`segment_memory` walks a graph segment in execution order and records each allocation and free
(a view allocates nothing; a value is freed after its last use), with sizes as functions of the bucket;
:func:`memory_section` adds up static buffers, graph outputs (one pool shared by the buckets where the
executor shares outputs) and the largest segment's peak intermediates at the cap, next to what capture
measured. For a segment ``y = relu(x @ w); return y + 1`` at bucket ``b`` (float32, hidden 8)::

    mem = segment_memory(segment, s0)
    mem.output_bytes(b)       # 4 * b * 8: the returned add
    mem.transient_bytes(b)    # 4 * b * 8: peak two [b, 8] values live at once, less the output
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import sympy
import torch

from ppcompile.debug.capture import owned_buffer_bytes
from ppcompile.runtime.executors import EXECUTORS
from ppcompile.symbolic import SizeFn, example_value, size_expr, size_hints

if TYPE_CHECKING:
    from ppcompile.runtime.stage_runtime import StageRuntime

__all__ = ["SegmentMemory", "memory_section", "segment_memory"]


class _Size:
    """A traced tensor's byte size as a function of the bucket (token symbol) and traced hints."""

    def __init__(self, value: torch.Tensor, token_symbol: sympy.Symbol | None) -> None:
        self.itemsize = value.dtype.itemsize
        self.dims = [SizeFn(size_expr(s)) for s in value.shape]
        self.hints: dict[sympy.Symbol, int] = {}
        for s in value.shape:
            for sym, hint in size_hints(s).items():
                if sym != token_symbol:
                    self.hints[sym] = 1 if hint is None else hint
        self.token_symbol = token_symbol

    def nbytes(self, bucket: int) -> int:
        env = dict(self.hints)
        if self.token_symbol is not None:
            env[self.token_symbol] = bucket
        return math.prod(d(env) for d in self.dims) * self.itemsize


@dataclasses.dataclass
class SegmentMemory:
    """A graph segment's outputs (they live as long as its graphs) and its allocations in order."""

    outputs: list[_Size]
    events: list[tuple[int, _Size]]  # (+1 allocated | -1 freed, size), in execution order

    def output_bytes(self, bucket: int) -> int:
        return sum(s.nbytes(bucket) for s in self.outputs)

    def transient_bytes(self, bucket: int) -> int:
        """Peak bytes of the segment's own intermediates at ``bucket``, beyond its outputs."""
        live = peak = 0
        for sign, size in self.events:
            live += sign * size.nbytes(bucket)
            peak = max(peak, live)
        return max(0, peak - self.output_bytes(bucket))


def segment_memory(submod: torch.fx.GraphModule, token_symbol: sympy.Symbol | None) -> SegmentMemory:
    """Allocations of a segment in execution order; a value is freed after the last use of it or of
    any view of it (a view allocates nothing)."""
    nodes = list(submod.graph.nodes)
    root: dict[torch.fx.Node, torch.fx.Node] = {}  # view -> the node that owns its memory
    owned: dict[torch.fx.Node, _Size] = {}
    for n in nodes:
        value = example_value(n)
        if n.op not in ("call_function", "call_method", "call_module") or not isinstance(value, torch.Tensor):
            continue
        if value._is_view():
            src = next((a for a in n.all_input_nodes if a in owned or a in root), None)
            if src is not None:
                root[n] = root.get(src, src)
        else:
            owned[n] = _Size(value, token_symbol)
    (out_node,) = [n for n in nodes if n.op == "output"]
    returned = {root.get(n, n) for n in out_node.all_input_nodes}
    last_use: dict[torch.fx.Node, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last_use[root.get(a, a)] = i
    events: list[tuple[int, _Size]] = []
    for i, n in enumerate(nodes):
        if n in owned:
            events.append((1, owned[n]))
        for a in {root.get(a, a) for a in n.all_input_nodes}:
            if last_use[a] == i and a in owned and a not in returned:
                events.append((-1, owned[a]))
    return SegmentMemory(outputs=[owned[n] for n in returned if n in owned], events=events)



def memory_section(runtime: StageRuntime, buffers: list[dict[str, Any]],
                   segments: Mapping[str, SegmentMemory], records: list[Any]) -> dict[str, Any]:
    static = owned_buffer_bytes(buffers)
    mems = list(segments.values())
    per_bucket = [sum(m.output_bytes(b) for m in mems) for b in runtime.plan.sizes]
    executor = EXECUTORS.get(runtime.graph_mode)  # its buckets may share graph output memory
    shared = executor is not None and executor.shares_outputs
    outputs = max(per_bucket, default=0) if shared else sum(per_bucket)
    transient = max((m.transient_bytes(runtime.plan.cap) for m in mems), default=0)
    done = [r for r in records if r.failed is None]
    measured = [r.measured_bytes for r in done if r.measured_bytes is not None]
    return {
        "static_buffer_bytes": static,
        "graph_output_bytes": outputs,
        "transient_bytes": transient,
        "estimated_graph_bytes": static + outputs + transient if mems else None,
        "captured_output_bytes": sum(r.output_bytes for r in done) if done else None,
        "measured_graph_bytes": sum(measured) if measured else None,
        "note": "estimate per captured instance: static buffers at the cap (bridges that share one "
                "counted once) + graph outputs (the buckets "
                "share one pool: the largest bucket's) + the largest segment's peak intermediates at the "
                "cap; measured: CUDA caching-allocator growth over capture (GPU only)",
    }

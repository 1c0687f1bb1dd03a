"""Small frozen records shared by the passes, the runtime and the reports."""

from __future__ import annotations

import dataclasses
import enum
import types
from collections.abc import Mapping

import torch

__all__ = ["BREAK_KINDS", "BreakKind", "BreakKindInfo", "BreakReason", "InputKind", "RunMerge", "Segment",
           "SegmentCompile", "StaticBuffer", "break_kind_info"]


class BreakKind(str, enum.Enum):
    """Why a segment runs eagerly between graph segments. A new kind is a member here and its row of
    ``BREAK_KINDS`` (below); ``passes/split_at_breaks._break_reason`` holds the rule that finds it."""

    ATTENTION = "attention"
    USER_SPLIT_OP = "user split op"
    NON_TOKEN_SHAPE = "non-token dynamic shape"
    UNSAFE_OP = "padding-unsafe op"
    CAPTURE_UNSAFE = "capture-unsafe op"
    HOST_SCALAR = "host scalar argument"
    NO_TENSOR_OUTPUTS = "no tensor outputs"
    EAGER_REGION = "declared eager region"
    STATE_WRITE = "engine state write"


class RunMerge(str, enum.Enum):
    """How a break joins the break right before it when that one is of the same kind (adjacent breaks are
    always one break segment; a break of another kind always joins as ``JOIN`` does)."""

    EXTEND = "extend"  # one reason for the run, naming every op of it ("padding-unsafe op: mean, sub")
    JOIN = "join"  # named in the first reason's detail ("joined with the next break (...)"), layer id kept


@dataclasses.dataclass(frozen=True)
class BreakKindInfo:
    """One row of ``BREAK_KINDS``: what the split and the reports need to know about a ``BreakKind``."""

    description: str  # why a break of this kind runs eagerly, as the reports explain it
    color: str  # its colour in report.html (CSS hex)
    merge: RunMerge  # how it joins an adjacent break of the same kind


BREAK_KINDS: Mapping[BreakKind, BreakKindInfo] = types.MappingProxyType({
    BreakKind.ATTENTION: BreakKindInfo(
        "an attention op (a registered one or scaled_dot_product_attention) runs on the live tokens",
        "#f28e2b", RunMerge.JOIN),
    BreakKind.USER_SPLIT_OP: BreakKindInfo("an op listed in the split_ops option", "#b07aa1", RunMerge.JOIN),
    BreakKind.NON_TOKEN_SHAPE: BreakKindInfo(
        "a shape or size argument depends on a dynamic symbol other than the token count: a graph "
        "captured per token bucket would replay a stale size", "#76b7b2", RunMerge.EXTEND),
    BreakKind.UNSAFE_OP: BreakKindInfo(
        "the op mixes token rows (check_padding_safety): in a graph it would read a bucket's padded rows",
        "#e15759", RunMerge.EXTEND),
    BreakKind.CAPTURE_UNSAFE: BreakKindInfo(
        "a CUDA graph cannot capture the op (check_capture_safety)", "#9d4f2f", RunMerge.EXTEND),
    BreakKind.HOST_SCALAR: BreakKindInfo(
        "the op reads a Python number passed per call, which a graph would replay stale", "#edc948",
        RunMerge.EXTEND),
    BreakKind.NO_TENSOR_OUTPUTS: BreakKindInfo(
        "the segment computes only numbers (size arithmetic): nothing for a graph to replay", "#bab0ac",
        RunMerge.JOIN),
    BreakKind.EAGER_REGION: BreakKindInfo(
        "the ops were traced inside a declared eager region (ppcompile.eager_region): one break as a whole",
        "#ff9da7", RunMerge.JOIN),
    BreakKind.STATE_WRITE: BreakKindInfo(
        "an engine op writes state (a KV cache, say) through the engine's forward context", "#59a14f",
        RunMerge.JOIN),
})


def break_kind_info(kind: BreakKind | str) -> BreakKindInfo | None:
    """The ``BREAK_KINDS`` row of ``kind``, a member or its value as a report stores it; None for a value
    no member has (a report another version wrote)."""
    try:
        return BREAK_KINDS[BreakKind(kind)]
    except ValueError:
        return None


@dataclasses.dataclass(frozen=True)
class BreakReason:
    """Why one break segment exists: its kind, the op that caused it and a human-readable detail."""

    kind: BreakKind
    op: str
    detail: str = ""
    stack_trace: str | None = None

    def __str__(self) -> str:
        return f"{self.kind.value}: {self.op}" + (f" ({self.detail})" if self.detail else "")


class InputKind(str, enum.Enum):
    """What a top-level graph input is."""

    MODULE_STATE = "module state"  # parameter or buffer: fixed address, read directly by graphs
    TENSOR = "tensor"  # a live input (token inputs, PP proxies, ...): copied into a static buffer
    SYMINT = "symint"  # a dynamic size: evaluated for the bucket (graphs) or the live count (breaks)
    # Python numbers Dynamo passes as 0-dim CPU tensors (unspecialized floats):
    CONSTANT_SCALAR = "constant scalar"  # an attribute (a norm's eps): baked into graphs, keyed by value
    SCALAR_ARG = "scalar argument"  # passed per call: ops that read it run eagerly
    OTHER = "other"


@dataclasses.dataclass(frozen=True)
class Segment:
    """One piece of the split stage graph, in execution order."""

    name: str
    kind: str  # "graph" or "break"
    num_nodes: int
    reason: BreakReason | None = None
    layer_ids: tuple[int, ...] = ()
    token_local_regions: tuple[str, ...] = ()  # declared token-local regions whose ops it holds

    @property
    def is_graph(self) -> bool:
        return self.kind == "graph"


@dataclasses.dataclass(frozen=True)
class StaticBuffer:
    """A static placeholder buffer that graphs read: a lifted input or a bridge from a break segment.

    ``shape`` is the size at the largest bucket; ``token_dims`` are the dims that scale with tokens.
    """

    name: str
    role: str  # "input" or "bridge"
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    token_dims: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class SegmentCompile:
    """How one graph segment got its callable: compiled here (``seconds`` spent) or reused by key."""

    segment: str  # submodule name in the split stage graph
    key: str  # structural key (16 hex digits); equal keys share one artifact
    compiler: str
    seconds: float  # compile time spent for this segment (0.0 when reused)
    reused: bool
    sizes: tuple[int, ...] = ()  # buckets with a specialised (static-shape) artifact


@dataclasses.dataclass(frozen=True)
class Collective:
    """A collective the stage graph calls: its op and the process group it names (``group``: the c10d
    group name a functional collective carries; None for a declared ``collective_ops`` op, whose group
    the graph does not show). ``unsafe``: why it may not run on padded rows (it moves token rows between
    ranks), or None when it stays in graph segments."""

    op: str
    group: str | None
    unsafe: str | None = None

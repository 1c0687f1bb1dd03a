"""Small frozen records shared by the passes, the runtime and the reports."""

from __future__ import annotations

import dataclasses
import enum

import torch

__all__ = ["BreakKind", "BreakReason", "InputKind", "Segment", "SegmentCompile", "StaticBuffer"]


class BreakKind(str, enum.Enum):
    """Why a segment runs eagerly between graph segments."""

    ATTENTION = "attention"
    USER_SPLIT_OP = "user split op"
    NON_TOKEN_SHAPE = "non-token dynamic shape"
    UNSAFE_OP = "padding-unsafe op"
    CAPTURE_UNSAFE = "capture-unsafe op"
    HOST_SCALAR = "host scalar argument"
    NO_TENSOR_OUTPUTS = "no tensor outputs"
    EAGER_REGION = "declared eager region"
    STATE_WRITE = "engine state write"


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

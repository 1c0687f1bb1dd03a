"""Static buffers, one home for their layout: traced layouts, stride equality, overlap, allocation,
bucket views and the copy-in that fills them from live tensors.

Lowering describes each buffer once (:class:`BufferPlan`: the slot whose value it holds, its role, the
layout its graph segments were traced for, how each bucket views it); a stage instance allocates and
views buffers through that plan, and the generated per-call code copies into them
(:func:`copy_rows`, :func:`copy_in`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import sympy
import torch

from ppcompile.records import StaticBuffer
from ppcompile.symbolic import SizeFn, size_expr

__all__ = ["BufferPlan", "TensorLayout", "allocate", "bucket_view", "check_static_layout", "copy_in",
           "copy_out", "copy_rows", "follows_token_count", "narrow_to", "non_overlapping", "strides_match",
           "zero_stale_rows"]

TokenDims = tuple[tuple[int, SizeFn], ...]
Env = Mapping[sympy.Symbol, int]


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


def follows_token_count(layout: TensorLayout, token: sympy.Symbol | None) -> bool:
    """Whether ``layout``'s strides follow the token count (a column-major ``[T, H]``: strides
    ``[1, T]``). A narrowed view of one buffer cannot have them at every bucket, so each bucket views the
    buffer's memory with its own strides. The stride of a dim of size 1 addresses nothing else and does
    not count (``[1, T, H]``, strides ``[T * H, H, 1]``)."""
    return token is not None and any(token in stride.expr.free_symbols
                                     for size, stride in zip(layout.sizes, layout.strides)
                                     if size.expr != 1)


@dataclasses.dataclass(frozen=True)
class BufferPlan:
    """One static buffer, as lowering planned it: the slot whose value it holds (a lifted input or a
    bridged break output), its spec (role, name, largest-bucket shape, dtype, device), its token dims,
    and, for compiled segments, the layout they were traced for (``None``: eager segments read any
    layout, so the buffer is row-major)."""

    slot: int
    spec: StaticBuffer
    what: str  # for messages: "input 'x'", "the output 0 of break segment submod_1"
    token_dims: TokenDims
    layout: TensorLayout | None = None
    per_bucket_strides: bool = False  # :func:`follows_token_count`: each bucket views it with its strides
    # A bridge that reuses the buffer of the bridge in this slot (same layout; their live ranges do not
    # overlap): ``lowering/bridge_memory.py``.
    shares_with: int | None = None

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def fusable(self) -> bool:
        """Whether a fused copier can fill it: a copier binds one layout and narrows one dim."""
        return len(self.token_dims) <= 1 and not self.per_bucket_strides

    @property
    def token_dim(self) -> int | None:
        return self.token_dims[0][0] if self.token_dims else None

    def allocate(self, env_max: Env) -> torch.Tensor:
        """The buffer at the largest bucket (``env_max``), in the traced layout (:func:`allocate`)."""
        traced = None if self.layout is None else self.layout.at(env_max)
        return allocate(self.spec, None if traced is None else traced[1])

    def view(self, buf: torch.Tensor, env: Env, bucket: int) -> torch.Tensor:
        """What graphs of ``bucket`` (``env``) read and write of ``buf``, checked against the traced
        layout (:func:`bucket_view`, :func:`check_static_layout`)."""
        if self.per_bucket_strides:
            assert self.layout is not None
            view = bucket_view(buf, self.token_dims, env, self.layout.at(env), self.what)
        else:
            view = bucket_view(buf, self.token_dims, env)
        if self.layout is not None:
            check_static_layout(self.what, self.layout, view, env, bucket)
        return view


def allocate(spec: StaticBuffer, strides: Sequence[int] | None = None) -> torch.Tensor:
    """A zero-filled buffer of ``spec``'s largest-bucket shape for graph segments compiled for the traced
    layout, whose strides at the largest bucket are ``strides``:

    * strides without self-overlap: a buffer with exactly these strides. Its bucket views
      (:func:`bucket_view`) then have the traced strides at every bucket. This covers inputs that are
      not contiguous, such as hidden states sliced out of a receive buffer that holds hidden states and
      residual side by side (strides ``[2H, 1]`` for ``[T, H]``: the buffer keeps the gaps), and values
      whose strides follow the token count (a column-major ``[T, H]``, strides ``[1, T]``). Copy-in
      fills its rows from any source layout.
    * overlapping strides (a broadcast input; rows written in one place would land in another): dense,
      with its dims in the memory order of ``strides`` (outermost first); row-major without strides.

    Made in the caller's inference mode: under ``torch.inference_mode()`` it is an inference tensor,
    like everything eager creates there, so what the graph path returns looks to Dynamo exactly like
    what the eager path returns (a mismatch would recompile the next stage). The runtime keeps one set
    of buffers per mode.
    """
    shape = tuple(spec.shape)
    with torch.no_grad():
        if strides is None or len(strides) != len(shape):
            return torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        if non_overlapping(shape, strides):
            buf = torch.empty_strided(shape, tuple(strides), dtype=spec.dtype, device=spec.device)
            return buf.zero_()
        order = sorted(range(len(shape)), key=lambda d: -strides[d])  # outermost first; stable on ties
        physical = torch.zeros([shape[d] for d in order], dtype=spec.dtype, device=spec.device)
        return physical.permute([order.index(d) for d in range(len(shape))])


def bucket_view(
    buf: torch.Tensor, dims: TokenDims, env: Env, layout: tuple[Sequence[int], Sequence[int]] | None = None,
    what: str = "a value",
) -> torch.Tensor:
    """What graphs of one bucket (``env``) read and write of the static buffer ``buf``: ``buf`` narrowed
    along its token ``dims``, or, given the bucket's traced ``layout`` ``(shape, strides)`` (for strides
    that follow the token count), ``buf``'s memory viewed with exactly those. Raises ``RuntimeError``,
    naming ``what`` the buffer holds, when that layout does not fit ``buf``'s memory or overlaps itself."""
    if layout is None:
        return narrow_to(buf, dims, env)
    shape, strides = layout
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if all(shape) else 0
    room = buf.untyped_storage().nbytes() // buf.element_size() - buf.storage_offset()
    if extent > room or not non_overlapping(shape, strides):
        problem = "overlaps itself" if extent <= room else "needs more memory than the largest bucket's"
        raise RuntimeError(
            f"pp_breakable: the static buffer of {what} cannot be viewed as shape {list(shape)}, strides "
            f"{list(strides)} (its traced layout at this bucket): that layout {problem}")
    return buf.as_strided(tuple(shape), tuple(strides), buf.storage_offset())


def non_overlapping(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether no two elements of a ``shape`` tensor with ``strides`` share an address (each dim's
    stride clears the extent of the dims inside it)."""
    extent = 1
    for d in sorted((d for d in range(len(shape)) if shape[d] > 1), key=lambda d: strides[d]):
        if strides[d] < extent:
            return False
        extent = strides[d] * shape[d]
    return True


def narrow_to(t: torch.Tensor, dims: TokenDims, env: Env) -> torch.Tensor:
    """``t`` narrowed along each token dim to its size for ``env`` (a view; no copy)."""
    for d, size in dims:
        length = size(env)
        if length != t.shape[d]:
            t = t.narrow(d, 0, length)
    return t


def copy_out(buf: torch.Tensor, src: torch.Tensor, layout: TensorLayout, env_live: Env) -> torch.Tensor:
    """Copies live ``src`` into ``buf`` (an output's ring slot: flat memory for its largest size) viewed
    with ``layout``'s live shape and strides, eager's; returns that view."""
    at = layout.at(env_live)
    assert at is not None, "a ring output's layout names a symbol the call does not bind"
    view = buf.as_strided(*at)
    view.copy_(src)
    return view


def extent(shape: Sequence[int], strides: Sequence[int]) -> int:
    """Elements a tensor of ``shape`` and ``strides`` spans from its first element (0 when empty)."""
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, strides))


def copy_rows(buf: torch.Tensor, src: torch.Tensor, dim: int, n: int, b: int) -> None:
    """Copies ``src`` into the first ``n`` entries of ``buf`` along ``dim``; zeroes entries ``n:b``."""
    buf.narrow(dim, 0, n).copy_(src)
    if b > n:
        buf.narrow(dim, n, b - n).zero_()


def zero_stale_rows(buf: torch.Tensor, dim: int, n: int, b: int, marks: list[int], k: int) -> None:
    """Before ``n`` live rows are copied into ``buf`` (a bucket ``b`` view along ``dim``), zeroes the rows
    ``n:b`` an earlier call left non-zero: ``marks[k]`` bounds the rows of the buffer's memory written
    since they were last zeroed (every bucket's view starts at row 0), and becomes that bound after
    this call (at least ``n``)."""
    m = marks[k]
    if m > n:
        buf.narrow(dim, n, min(m, b) - n).zero_()
    marks[k] = m if m > b else n


def copy_in(buf: torch.Tensor, src: torch.Tensor, dims: TokenDims, env_live: Env, env_bucket: Env) -> None:
    """Copies live ``src`` into ``buf``'s first rows and zeroes the padding rows up to the bucket."""
    if not dims:
        buf.copy_(src)
        return
    if len(dims) == 1:
        (d, size), = dims
        copy_rows(buf, src, d, size(env_live), size(env_bucket))
        return
    narrow_to(buf, dims, env_bucket).zero_()
    narrow_to(buf, dims, env_live).copy_(src)


def check_static_layout(what: str, layout: TensorLayout, view: torch.Tensor,
                        env: Mapping[sympy.Symbol, int], bucket: int) -> None:
    """Raises ``RuntimeError`` when the bucket view of a static buffer is not laid out as the graph
    segments reading it were compiled for (checked once per bucket, at capture). Inductor segments
    have no input asserts of their own, so without this they would read it with the wrong strides."""
    traced = layout.at(env)
    if traced is None:  # a size of a symbol no call binds: Dynamo guards it
        return
    shape, stride = traced
    same_strides = strides_match(view.stride(), stride, shape)
    if tuple(view.shape) == shape and same_strides and view.dtype == layout.dtype:
        return
    raise RuntimeError(
        f"pp_breakable: the static buffer of {what} at bucket {bucket} has shape {list(view.shape)}, "
        f"strides {list(view.stride())} and dtype {view.dtype}, but the graph segments reading it were "
        f"compiled for shape {list(shape)}, strides {list(stride)} and dtype {layout.dtype} (its traced "
        "layout). A static buffer takes the traced strides, unless they make elements overlap (a "
        "broadcast value), where it is dense; make the value contiguous in the model (e.g. "
        ".contiguous() after the op that makes it), "
        "or use graph_mode='none'")

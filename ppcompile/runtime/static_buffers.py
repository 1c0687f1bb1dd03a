"""Static buffers: allocation, bucket views, and the copy-in that fills them from live tensors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import sympy
import torch

from ppcompile.records import StaticBuffer
from ppcompile.symbolic import SizeFn

__all__ = ["allocate", "bucket_view", "copy_in", "copy_rows", "narrow_to", "non_overlapping"]

TokenDims = tuple[tuple[int, SizeFn], ...]
Env = Mapping[sympy.Symbol, int]


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


def copy_rows(buf: torch.Tensor, src: torch.Tensor, dim: int, n: int, b: int) -> None:
    """Copies ``src`` into the first ``n`` entries of ``buf`` along ``dim``; zeroes entries ``n:b``."""
    buf.narrow(dim, 0, n).copy_(src)
    if b > n:
        buf.narrow(dim, n, b - n).zero_()


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

"""The row copier's contract (:mod:`ppcompile.runtime.fused_copy` makes copiers): the destinations a copier
binds, the check of each call's sources and the error naming a source that does not fit, the
:class:`RowCopier` interface, and :class:`TorchRowCopier`, the per-tensor torch ops (the reference the Triton
copier is tested against, and the fallback where it cannot run)::

    buf = torch.zeros(8, 4)
    copier = make_row_copier([buf], dims=[0], kernel="torch")   # a TorchRowCopier
    copier([torch.ones(3, 4)], ns=[3], bs=[4])    # buf[:3] = 1; buf[3:4] = 0; buf[4:] untouched
    copier([torch.ones(3, 5)], ns=[3], bs=[4])
    # CopyMismatchError: row copier: source 0: expected shape [3, 4] (3 rows along token dim 0), got [3, 5]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ppcompile.runtime.static_buffers import copy_rows

__all__ = ["INT_TYPES", "Buffer", "CopyMismatchError", "RowCopier", "TorchRowCopier", "bad", "bad_count",
           "check_sources"]

INT_TYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class CopyMismatchError(ValueError):
    """A row copier was called with sources that do not fit its buffers."""


@dataclass(frozen=True)
class Buffer:
    """One bound destination: ``dst`` (any strides), its token dim (None: plain full copy)."""

    index: int
    dst: torch.Tensor
    dim: int | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    device_index: int  # dst.get_device(): -1 on CPU

    @property
    def rows(self) -> int:
        return self.shape[self.dim] if self.dim is not None else 1

    def expected(self, n: int) -> list[int]:
        return [n if d == self.dim else s for d, s in enumerate(self.shape)]


def check_sources(
    buffers: Sequence[Buffer], srcs: Sequence[Any], ns: Sequence[int], bs: Sequence[int]
) -> None:
    """Raises :class:`CopyMismatchError` naming the first source that does not fit its buffer."""
    if not len(srcs) == len(ns) == len(bs) == len(buffers):
        bad_count(len(buffers), srcs, ns, bs)
    for buf, src, n, b in zip(buffers, srcs, ns, bs):
        if (not isinstance(src, torch.Tensor) or src.dtype is not buf.dtype
                or src.get_device() != buf.device_index or list(src.shape) != buf.expected(n)
                or (buf.dim is not None and not 0 <= n <= b <= buf.rows)):
            bad(buf, src, n, b)


def bad_count(k: int, srcs: Sequence[Any], ns: Sequence[int], bs: Sequence[int]) -> None:
    """Raises the error for a call whose sources, token counts or buckets are not one per bound buffer."""
    raise CopyMismatchError(f"row copier: binds {k} buffers; got {len(srcs)} sources, {len(ns)} token counts "
                            f"and {len(bs)} buckets")


def bad(buf: Buffer, src: Any, n: int, b: int) -> None:
    """Raises the error for source ``buf.index`` (``check_sources`` found it wrong)."""
    where = f"row copier: source {buf.index}"
    if not isinstance(src, torch.Tensor):
        raise CopyMismatchError(f"{where}: expected a tensor, got {type(src).__name__}")
    if src.dtype is not buf.dtype:
        raise CopyMismatchError(f"{where}: expected dtype {buf.dtype}, got {src.dtype} (no casts: the copy "
                                "is bit for bit)")
    if src.get_device() != buf.device_index:
        raise CopyMismatchError(f"{where}: expected device {buf.device}, got {src.device}")
    if buf.dim is not None and not 0 <= n <= b <= buf.rows:
        raise CopyMismatchError(f"{where}: n={n}, b={b}: need 0 <= n <= b <= {buf.rows} (the buffer's size "
                                f"along token dim {buf.dim})")
    rows = f" ({n} rows along token dim {buf.dim})" if buf.dim is not None else ""
    raise CopyMismatchError(f"{where}: expected shape {buf.expected(n)}{rows}, got {list(src.shape)}")


class RowCopier:
    """Copies sources into bound static buffers: ``copier(srcs, ns, bs)`` does, for each ``i``,
    ``dst_i.narrow(d_i, 0, n_i).copy_(src_i)`` and ``dst_i.narrow(d_i, n_i, b_i - n_i).zero_()`` (a buffer
    without a token dim: ``dst_i.copy_(src_i)``; its ``n_i`` and ``b_i`` are ignored). Sources must have the
    buffer's dtype and device and its shape with ``n_i`` along the token dim; ``0 <= n_i <= b_i <= rows``.
    Anything else raises :class:`CopyMismatchError` naming the source, before anything is written.
    No autograd: buffers and sources are plain memory here (the graph path runs without grad)."""

    kernel: str  # "triton" | "torch"

    def __init__(self, buffers: tuple[Buffer, ...]) -> None:
        self._buffers = buffers

    @property
    def buffers(self) -> tuple[Buffer, ...]:
        return self._buffers

    @property
    def dsts(self) -> tuple[torch.Tensor, ...]:
        return tuple(b.dst for b in self._buffers)

    @property
    def dims(self) -> tuple[int | None, ...]:
        return tuple(b.dim for b in self._buffers)

    @property
    def launches_per_call(self) -> int:
        """Kernel launches of one call (at most: the torch path skips ``zero_`` when ``n == b``)."""
        raise NotImplementedError

    @property
    def compiles(self) -> int:
        """Kernels generated so far (the torch path: none)."""
        return 0

    @property
    def launch_path(self) -> str:
        """How a call launches: ``"torch"`` (per-tensor ops), ``"direct"`` (the compiled Triton kernel's
        launcher, raw pointers), ``"dispatch"`` (Triton's own dispatch), ``"interpreter"``; "" before the
        first call of a Triton copier."""
        return "torch"

    def __call__(self, srcs: Sequence[torch.Tensor], ns: Sequence[int], bs: Sequence[int]) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        k, launches = len(self._buffers), self.launches_per_call
        return f"{type(self).__name__}({k} buffers, {launches} launches per call)"


class TorchRowCopier(RowCopier):
    """The per-tensor torch ops: ``copy_`` and ``zero_`` per buffer."""

    kernel = "torch"

    @property
    def launches_per_call(self) -> int:
        return sum(2 if b.dim is not None else 1 for b in self._buffers if b.dst.numel())

    def __call__(self, srcs: Sequence[torch.Tensor], ns: Sequence[int], bs: Sequence[int]) -> None:
        check_sources(self._buffers, srcs, ns, bs)
        for buf, src, n, b in zip(self._buffers, srcs, ns, bs):
            if buf.dim is None:
                buf.dst.copy_(src)
            else:
                copy_rows(buf.dst, src, buf.dim, n, b)


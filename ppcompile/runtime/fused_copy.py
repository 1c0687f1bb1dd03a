"""Fused copy-in: one kernel launch fills every static buffer of one copy point.

On the graph path, before the graphs of bucket ``b`` replay for ``n`` live tokens, each live input is copied
into the first ``n`` rows (along its token dim) of its static buffer and rows ``n..b`` are zeroed; after each
eager break, each break output that graphs read is copied into its static bridge the same way. Done with
torch ops that is two launches per tensor (``copy_`` and ``zero_``), each costing host time outside any
graph while the GPU waits. A :class:`RowCopier` binds the destinations of one copy point once
(:func:`make_row_copier`) and then, per call, copies all of them with ONE Triton kernel launch::

    copier = make_row_copier([hidden_buf, positions_buf], dims=[0, 0])   # static buffers, largest bucket
    copier([hidden, positions], ns=[n, n], bs=[b, b])
    # == for each i: dst_i.narrow(d_i, 0, n_i).copy_(src_i); dst_i.narrow(d_i, n_i, b_i - n_i).zero_()

The kernel copies raw bits (each dtype as the integer type of its size), so it is exact for every dtype,
NaN payloads included, and zero bits are zero for every dtype. Sources may have any strides (slices,
transposes, expanded dims); destinations any layout without self-overlap (permuted buffers too).

The kernel has the copier's exact arity and one ``if`` per tensor over a range of program ids, like
Inductor's foreach kernels, with the destinations' layouts and the sources' strides as first seen baked in
as constants; straight-line host code checks the sources and launches it with raw pointers, ``n`` and ``b``
(never specialized: no recompile as ``n`` changes). Where the pieces are: this module picks a copier
(:func:`make_row_copier`); ``fused_copy_base`` has the :class:`RowCopier` interface, the source checks and
the torch ops; ``fused_copy_triton`` binds and launches the generated code (and regenerates it when a
source's layout changes); ``fused_copy_codegen`` generates it, and its docstring shows the kernel and the
host function for an example.

Limits. Any rank (0 to 4 tested); dtypes of 1, 2, 4 or 8-byte elements (bool, integers, fp8, fp16, bf16,
fp32, fp64, complex64, ...): a 16-byte dtype (complex128), or a destination whose elements share memory,
makes ``kernel="auto"`` use the torch ops and ``kernel="triton"`` raise. Sources must not overlap the
destinations of other tensors of the same copier (the launch reads and writes them concurrently; ppcompile
copies inputs that alias its static buffers beforehand); a source may be its own destination's first rows
(an out-variant op that wrote in place). No autograd. The destinations are bound by address: a copier
lives as long as its buffers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ppcompile.runtime.fused_copy_base import (
    INT_TYPES,
    Buffer,
    CopyMismatchError,
    RowCopier,
    TorchRowCopier,
    check_sources,
)
from ppcompile.runtime.fused_copy_triton import TritonRowCopier
from ppcompile.runtime.static_buffers import non_overlapping

__all__ = ["INT_TYPES", "KERNELS", "CopyMismatchError", "RowCopier", "TorchRowCopier", "TritonRowCopier",
           "check_sources", "make_row_copier", "working_or_torch"]

log = logging.getLogger(__name__)

KERNELS = ("auto", "triton", "torch")


def _bind(dsts: Sequence[torch.Tensor], dims: Sequence[int | None]) -> tuple[Buffer, ...]:
    if len(dsts) != len(dims):
        raise ValueError(f"make_row_copier: {len(dsts)} buffers but {len(dims)} token dims; give one each "
                         "(None for a buffer without a token dim)")
    buffers = []
    for i, (dst, dim) in enumerate(zip(dsts, dims)):
        if not isinstance(dst, torch.Tensor):
            raise TypeError(f"make_row_copier: buffer {i} is a {type(dst).__name__}, not a tensor")
        if dim is not None:
            if not -dst.dim() <= dim < dst.dim():
                raise ValueError(f"make_row_copier: buffer {i} (shape {list(dst.shape)}) has no dim {dim}")
            dim %= dst.dim()
        buffers.append(Buffer(i, dst, dim, tuple(dst.shape), dst.dtype, dst.device, dst.get_device()))
    devices = {b.device for b in buffers}
    if len(devices) > 1:
        raise ValueError("make_row_copier: the buffers of one copier share a device; got "
                         f"{sorted(map(str, devices))}")
    return tuple(buffers)


def make_row_copier(
    dsts: Sequence[torch.Tensor], dims: Sequence[int | None], *, kernel: str = "auto"
) -> RowCopier:
    """A copier bound to the static buffers ``dsts`` (largest bucket, any layout) with token dims ``dims``
    (None: a buffer copied whole). ``kernel``: ``"triton"`` (one launch per call; raises when Triton is
    missing or cannot run on the buffers' device: CUDA, or CPU under ``TRITON_INTERPRET=1``), ``"torch"``
    (two ops per buffer), ``"auto"`` (Triton on CUDA when it is importable, supports the buffers' dtypes
    and layouts, and its kernel builds and launches: :func:`working_or_torch`; else torch)."""
    if kernel not in KERNELS:
        raise ValueError(f"make_row_copier: kernel={kernel!r}; expected one of {', '.join(KERNELS)}")
    buffers = _bind(dsts, dims)
    if kernel == "torch":
        return TorchRowCopier(buffers)
    reason, interpret = _triton_unsupported(buffers)
    if kernel == "auto":
        if reason is None and not interpret and buffers and buffers[0].device.type == "cuda":
            return working_or_torch(TritonRowCopier(buffers, interpret=False))
        if reason is not None:
            log.debug("row copier: per-tensor torch ops: %s", reason)
        return TorchRowCopier(buffers)
    if reason is not None:
        raise RuntimeError(f"make_row_copier(kernel='triton'): {reason}")
    return TritonRowCopier(buffers, interpret)


def working_or_torch(copier: RowCopier) -> RowCopier:
    """``copier``, once a call copying each of its buffers onto itself ran (the first call builds the
    Triton kernel and its launcher: a compiler, Python headers and libcuda it needs, which can fail), or
    the torch ops over the same buffers, with a warning, if that call raised."""
    dsts = copier.dsts
    rows = [d.shape[dim] if dim is not None else 1 for d, dim in zip(dsts, copier.dims)]
    try:
        copier(dsts, rows, rows)
    except Exception as e:
        log.warning("row copier: the %s kernel failed its first call (%s: %s); copying with torch ops "
                    "instead (copy_kernel='torch' skips the attempt)", copier.kernel, type(e).__name__, e)
        return TorchRowCopier(copier.buffers)
    return copier


def _triton_unsupported(buffers: Sequence[Buffer]) -> tuple[str | None, bool]:
    """Why the Triton kernel cannot copy into ``buffers`` (None: it can), and whether Triton interprets."""
    try:
        import triton
    except ImportError as e:
        return f"triton is not importable ({e}); install it (pip install triton) or use kernel='torch'", False
    knobs = getattr(triton, "knobs", None)
    interpret = bool(knobs is not None and knobs.runtime.interpret)
    if not buffers:
        return None, interpret
    device = buffers[0].device
    if device.type == "cpu" and not interpret:
        return ("the buffers are on the CPU, where Triton kernels run only under its interpreter "
                "(TRITON_INTERPRET=1, set before the copier is made)"), interpret
    if device.type not in ("cpu", "cuda"):
        return f"the buffers are on {device}; the kernel runs on CUDA (or the CPU interpreter)", interpret
    for b in buffers:
        if b.dtype.itemsize not in INT_TYPES:
            why = f"buffer {b.index}: {b.dtype} has {b.dtype.itemsize}-byte elements (supported: 1, 2, 4, 8)"
            return why, interpret
        if not non_overlapping(b.shape, b.dst.stride()):
            return (f"buffer {b.index} (shape {list(b.shape)}, strides {list(b.dst.stride())}) has elements "
                    "sharing memory or an unordered layout"), interpret
    return None, interpret


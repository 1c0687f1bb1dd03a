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

The generated kernel (``fused_copy_codegen``) has the copier's exact arity and one ``if`` per tensor over a
range of program ids, like Inductor's foreach kernels; the destinations' shapes and strides, and the
sources' strides as first seen, are constants in its source. For a ``[8192, 4096]`` bf16 buffer and an
``[8192]`` int64 one, both with contiguous sources::

    @triton.jit(do_not_specialize=['n0', 'b0', 'n1', 'b1'])
    def ppcompile_row_copy(d0, s0, n0: tl.int32, b0: tl.int32, d1, s1, n1: tl.int32, b1: tl.int32):
        pid = tl.program_id(0)
        # tensor 0: axes (size:dst stride/src stride) [b:4096/4096, 4096:1/1], block 4096
        end0 = (b0 * 4096 + 4095) // 4096
        if pid < end0:
            e0 = pid * 4096 + tl.arange(0, 4096)
            r0 = e0
            x0_1 = r0 % 4096
            r0 = r0 // 4096
            m0 = e0 < b0 * 4096
            v0 = tl.load(s0 + (r0 * 4096 + x0_1), mask=m0 & (r0 < n0), other=0)
            tl.store(d0 + (r0 * 4096 + x0_1), v0, mask=m0)
        # tensor 1: axes (size:dst stride/src stride) [b:1/1], block 1024
        end1 = end0 + (b1 + 1023) // 1024
        if (pid >= end0) & (pid < end1):
            ...

The loads and stores are masked, so the flat index needs no bounds of its own; constant strides let Triton
prove contiguity and alignment, and the main case moves 16 bytes per load and store. The host side is
generated too: straight-line code that checks each source (dtype, device, shape, and
``0 <= n <= b <= rows``) and launches the compiled kernel directly with raw pointers, ``n`` and ``b``
(never specialized: no recompile as ``n`` changes; no per-call host-to-device copy of metadata)::

    def row_copy(srcs, ns, bs):
        ...
        s0, s1, = srcs
        n0, n1, = ns
        b0, b1, = bs
        z = s0.shape
        if s0.dtype is not dtype_0 or len(z) != 2 or z[0] != n0 or z[1] != 4096 or ...:
            bad(0, s0, n0, b0)
        p0 = s0.data_ptr()
        if n0:
            st = s0.stride()
            if p0 & 15 or (n0 > 1 and st[0] != 4096) or st[1] != 1:
                return slow(srcs, ns, bs)
        ...
        grid = (b0 * 4096 + 4095) // 4096 + (b1 + 1023) // 1024
        if grid:
            run(grid, 1, 1, stream(DEV), FN, META, None, None, None, D0, p0, n0, b0, D1, p1, n1, b1)

A source whose layout differs from the one baked in (along a dim the copy steps: a new alignment, or
strides that change with ``n``, like a ``[3, n]`` source with token dim 1) sends the call to a slow path,
which records it and builds the kernel for it (that source's strides become kernel arguments once they
have changed). A copier so compiles a few kernels at most, during its first calls; ``compiles`` counts them.
On the Triton interpreter, or a Triton whose compiled kernels lack the launcher this binds, the same host
code launches through Triton's own dispatch (``launch_path`` says which).

Limits. Any rank (0 to 4 tested); dtypes of 1, 2, 4 or 8-byte elements (bool, integers, fp8, fp16, bf16,
fp32, fp64, complex64, ...): a 16-byte dtype (complex128), or a destination whose elements share memory,
makes ``kernel="auto"`` use the torch ops and ``kernel="triton"`` raise. Sources must not overlap the
destinations of other tensors of the same copier (the launch reads and writes them concurrently; ppcompile
copies inputs that alias its static buffers beforehand); a source may be its own destination's first rows
(an out-variant op that wrote in place). No autograd. The destinations are bound by address: a copier
lives as long as its buffers.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ppcompile import envs
from ppcompile.runtime import fused_copy_codegen as codegen
from ppcompile.runtime.static_buffers import copy_rows

__all__ = ["KERNELS", "CopyMismatchError", "RowCopier", "TorchRowCopier", "TritonRowCopier", "check_sources",
           "make_row_copier"]

log = logging.getLogger(__name__)

KERNELS = ("auto", "triton", "torch")
INT_TYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
NUM_WARPS = 4


class CopyMismatchError(ValueError):
    """A row copier was called with sources that do not fit its buffers."""


@dataclass(frozen=True)
class _Buffer:
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


def _bind(dsts: Sequence[torch.Tensor], dims: Sequence[int | None]) -> tuple[_Buffer, ...]:
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
        buffers.append(_Buffer(i, dst, dim, tuple(dst.shape), dst.dtype, dst.device, dst.get_device()))
    devices = {b.device for b in buffers}
    if len(devices) > 1:
        raise ValueError("make_row_copier: the buffers of one copier share a device; got "
                         f"{sorted(map(str, devices))}")
    return tuple(buffers)


def check_sources(
    buffers: Sequence[_Buffer], srcs: Sequence[Any], ns: Sequence[int], bs: Sequence[int]
) -> None:
    """Raises :class:`CopyMismatchError` naming the first source that does not fit its buffer."""
    if not len(srcs) == len(ns) == len(bs) == len(buffers):
        _bad_count(len(buffers), srcs, ns, bs)
    for buf, src, n, b in zip(buffers, srcs, ns, bs):
        if (not isinstance(src, torch.Tensor) or src.dtype is not buf.dtype
                or src.get_device() != buf.device_index or list(src.shape) != buf.expected(n)
                or (buf.dim is not None and not 0 <= n <= b <= buf.rows)):
            _bad(buf, src, n, b)


def _bad_count(k: int, srcs: Sequence[Any], ns: Sequence[int], bs: Sequence[int]) -> None:
    raise CopyMismatchError(f"row copier: binds {k} buffers; got {len(srcs)} sources, {len(ns)} token counts "
                            f"and {len(bs)} buckets")


def _bad(buf: _Buffer, src: Any, n: int, b: int) -> None:
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

    def __init__(self, buffers: tuple[_Buffer, ...]) -> None:
        self._buffers = buffers

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


@dataclass
class _Variant:
    """One generated kernel and its host functions (``checked``: the per-call path)."""

    plans: tuple[codegen.TensorPlan, ...]
    source: str
    checked: Callable[..., None]
    unchecked: Callable[..., None]
    launch_path: str


class TritonRowCopier(RowCopier):
    """One Triton launch per call (see the module docstring). ``compiles`` stays at 1 for sources whose
    layouts do not change; ``source`` is the current kernel's Triton source."""

    kernel = "triton"

    def __init__(self, buffers: tuple[_Buffer, ...], interpret: bool) -> None:
        super().__init__(buffers)
        self._interpret = interpret
        self._device = buffers[0].device if buffers else torch.device("cpu")
        self._direct = self._device.type == "cuda" and not interpret
        # Per source: its strides as seen so far (None: changes between calls, read per call), aligned.
        self._strides: list[list[int | None] | None] = [[None] * len(b.shape) for b in buffers]
        self._aligned = [True] * len(buffers)
        self._variants: dict[tuple[Any, ...], _Variant] = {}
        self._call: Callable[..., None] = self._slow
        self.source = ""  # the current kernel's source (for dumps and reports)
        self._launch_path = ""

    @property
    def compiles(self) -> int:
        return len(self._variants)

    @property
    def launch_path(self) -> str:
        return self._launch_path

    @property
    def launches_per_call(self) -> int:
        return int(any(b.dst.numel() for b in self._buffers))

    def __call__(self, srcs: Sequence[torch.Tensor], ns: Sequence[int], bs: Sequence[int]) -> None:
        self._call(srcs, ns, bs)

    def _slow(self, srcs: Sequence[torch.Tensor], ns: Sequence[int], bs: Sequence[int]) -> None:
        """Checks the call, records each source's layout, and copies with the kernel for those layouts."""
        check_sources(self._buffers, srcs, ns, bs)
        for buf, src in zip(self._buffers, srcs):
            if not src.numel():
                continue
            known = self._strides[buf.index]
            if known is not None:
                shape, stride = src.shape, src.stride()
                for d in range(len(known)):
                    if shape[d] <= 1:
                        continue  # the copy never steps along it
                    if known[d] is None:
                        known[d] = stride[d]
                    elif known[d] != stride[d]:
                        log.debug("row copier: source %d changed strides (dim %d: %d, now %d); they become "
                                  "kernel arguments", buf.index, d, known[d], stride[d])
                        self._strides[buf.index] = None
                        break
            if self._aligned[buf.index] and src.data_ptr() % 16:
                self._aligned[buf.index] = False
        variant = self._variant()
        self._call = variant.checked
        variant.unchecked(srcs, ns, bs)

    def _variant(self) -> _Variant:
        key = tuple((None if s is None else tuple(s), a) for s, a in zip(self._strides, self._aligned))
        variant = self._variants.get(key)
        if variant is None:
            variant = self._variants[key] = self._build()
        self.source, self._launch_path = variant.source, variant.launch_path
        return variant

    def _build(self) -> _Variant:
        plans = tuple(
            codegen.plan_tensor(b.index, b.shape, b.dst.stride(), b.dim, b.dtype.itemsize,
                                None if s is None else [x or 0 for x in s], a)
            for b, s, a in zip(self._buffers, self._strides, self._aligned))
        source = codegen.kernel_source(plans)
        names: dict[str, Any] = {"DEV": self._buffers[0].device_index if self._buffers else -1,
                                 "bad_count": functools.partial(_bad_count, len(self._buffers))}
        names["bad"] = functools.partial(_bad_by_index, self._buffers)
        me = weakref.ref(self)  # the generated functions must not keep the copier alive
        names["slow"] = lambda *args: _alive(me)._slow(*args)
        names["on_device"] = lambda *args: _alive(me)._on_device(*args)
        names["current_device"] = torch.cuda.current_device
        for b in self._buffers:
            names[f"dtype_{b.index}"] = b.dtype
        direct = self._direct and bool(source) and self._bind_direct(source, plans, names)
        if not direct and source:
            kernel = codegen.load_kernel(source, envs.cache_dir(), self._interpret)
            names["run"] = functools.partial(_launch_jit, kernel)
            for b in self._buffers:
                names[f"D{b.index}"] = b.dst.view(INT_TYPES[b.dtype.itemsize])
                names[f"I{b.index}"] = INT_TYPES[b.dtype.itemsize]
        guard = self._device.type == "cuda" and torch.cuda.device_count() > 1
        fns = [_exec(codegen.host_source(plans, direct, checked, guard), names) for checked in (True, False)]
        path = "direct" if direct else "interpreter" if self._interpret else "dispatch" if source else ""
        return _Variant(plans, source, fns[0], fns[1], path)

    def _bind_direct(self, source: str, plans: Sequence[codegen.TensorPlan], names: dict[str, Any]) -> bool:
        """Compiles the kernel now and binds its launcher for raw-pointer launches (Triton's own dispatch
        re-derives the specialization of every argument per call). False: use Triton's dispatch."""
        kernel = codegen.load_kernel(source, envs.cache_dir(), interpret=False)
        with torch.cuda.device(self._device):
            args: list[Any] = []
            for p in plans:
                if p.empty:
                    continue
                b = self._buffers[p.index]
                int_t = INT_TYPES[b.dtype.itemsize]
                args += [b.dst.view(int_t), torch.empty(1, dtype=int_t, device=self._device)]
                args += [0, 0] * p.token + [0] * len(p.dynamic)
            compiled = kernel.warmup(*args, grid=(1,), num_warps=NUM_WARPS)
            if hasattr(compiled, "result"):
                compiled = compiled.result()
            try:
                names["run"] = compiled.run  # loads the module (on this device)
                names["FN"], names["META"] = compiled.function, compiled.packed_metadata
            except AttributeError as e:  # another Triton's CompiledKernel
                log.info("row copier: launching through Triton's dispatch (%s)", e)
                return False
        from triton.runtime import driver

        names["stream"] = driver.active.get_current_stream
        for b in self._buffers:
            names[f"D{b.index}"] = b.dst.data_ptr()
        return True

    def _on_device(self, srcs: Sequence[torch.Tensor], ns: Sequence[int], bs: Sequence[int]) -> None:
        with torch.cuda.device(self._device):
            self._call(srcs, ns, bs)


def _alive(ref: weakref.ref[TritonRowCopier]) -> TritonRowCopier:
    copier = ref()
    assert copier is not None, "row copier: called after the copier was freed"
    return copier


def _bad_by_index(buffers: Sequence[_Buffer], i: int, src: Any, n: int, b: int) -> None:
    _bad(buffers[i], src, n, b)


def _launch_jit(kernel: Any, grid: int, *args: Any) -> None:
    kernel[(grid,)](*args, num_warps=NUM_WARPS)


def _exec(source: str, names: dict[str, Any]) -> Callable[..., None]:
    scope = dict(names)
    exec(compile(source, "<ppcompile row_copy>", "exec"), scope)
    fn: Callable[..., None] = scope["row_copy"]
    fn.source = source  # type: ignore[attr-defined]
    return fn


# ----------------------------------------------------------------------------------- choosing a kernel
def make_row_copier(
    dsts: Sequence[torch.Tensor], dims: Sequence[int | None], *, kernel: str = "auto"
) -> RowCopier:
    """A copier bound to the static buffers ``dsts`` (largest bucket, any layout) with token dims ``dims``
    (None: a buffer copied whole). ``kernel``: ``"triton"`` (one launch per call; raises when Triton is
    missing or cannot run on the buffers' device: CUDA, or CPU under ``TRITON_INTERPRET=1``), ``"torch"``
    (two ops per buffer), ``"auto"`` (Triton on CUDA when it is importable and supports the buffers' dtypes
    and layouts, else torch)."""
    if kernel not in KERNELS:
        raise ValueError(f"make_row_copier: kernel={kernel!r}; expected one of {', '.join(KERNELS)}")
    buffers = _bind(dsts, dims)
    if kernel == "torch":
        return TorchRowCopier(buffers)
    reason, interpret = _triton_unsupported(buffers)
    if kernel == "auto":
        if reason is None and not interpret and buffers and buffers[0].device.type == "cuda":
            return TritonRowCopier(buffers, interpret=False)
        if reason is not None:
            log.debug("row copier: per-tensor torch ops: %s", reason)
        return TorchRowCopier(buffers)
    if reason is not None:
        raise RuntimeError(f"make_row_copier(kernel='triton'): {reason}")
    return TritonRowCopier(buffers, interpret)


def _triton_unsupported(buffers: Sequence[_Buffer]) -> tuple[str | None, bool]:
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
        if _overlaps_itself(b.shape, b.dst.stride()):
            return (f"buffer {b.index} (shape {list(b.shape)}, strides {list(b.dst.stride())}) has elements "
                    "sharing memory or an unordered layout"), interpret
    return None, interpret


def _overlaps_itself(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether a layout may map two elements to one address: dims of size > 1, outermost first, must
    each step over everything inside them (a permuted layout with or without gaps passes)."""
    dims = sorted((st, size) for size, st in zip(shape, strides) if size > 1)
    span = 1
    for st, size in dims:
        if st < span:
            return True
        span = st * size
    return False

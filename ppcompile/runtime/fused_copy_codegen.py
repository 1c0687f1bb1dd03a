"""Source generation for the fused row copy (:mod:`ppcompile.runtime.fused_copy`): per-tensor layout plans,
the Triton kernel that copies all tensors of one copy point in one launch, and the straight-line host
function that checks the sources and launches it.

Nothing here imports Triton at import time; :func:`load_kernel` does, when a copier first needs a kernel.

A plan walks each destination region ``dst.narrow(d, 0, b)`` in the destination's memory order (outermost
axis first), with dims of size 1 dropped and neighbouring dims merged where both the destination and the
source are contiguous across them. A flat index ``e`` over the region splits into one index per axis;
offsets are ``sum(index * stride)`` with the destination's strides (fixed: the buffer is bound once) and the
source's strides, baked into the source as constants (a layout seen so far) or read from arguments (a
source whose strides change between calls).

The kernel (:func:`kernel_source`) has the copier's exact arity and one ``if`` per tensor over a range of
program ids, like Inductor's foreach kernels; the destinations' shapes and strides, and the sources' strides
as first seen, are constants in its source. For a ``[8192, 4096]`` bf16 buffer and an ``[8192]`` int64 one,
both with contiguous sources::

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
prove contiguity and alignment, and the main case moves 16 bytes per load and store. The host function
(:func:`host_source`) is straight-line code that checks each source (dtype, device, shape, and
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
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ppcompile.envs import untrusted_reason

__all__ = ["Axis", "TensorPlan", "host_source", "kernel_source", "load_kernel", "plan_tensor"]

log = logging.getLogger(__name__)

KERNEL_NAME = "ppcompile_row_copy"
INT32_LIMIT = 2**31 - 1
BLOCK_BYTES = 8192  # bytes one program copies: 4 warps x 32 lanes x 16 bytes x 4
MIN_BLOCK = 128


@dataclass(frozen=True)
class Axis:
    """One loop axis of a plan: ``size`` entries (the token axis: the bucket ``b``, at most ``size``)."""

    size: int
    dst_stride: int
    src_stride: int | None  # None: read from the argument ``st<i>_<dim>`` at run time
    dim: int  # the tensor dim whose stride this is (merged axes: the innermost one)
    token: bool


@dataclass(frozen=True)
class TensorPlan:
    """How the kernel copies tensor ``index`` (destination ``shape``): ``rows`` token rows (1 without a token
    dim) of ``inner`` elements each, walked along ``axes`` (outermost first) in blocks of ``block``."""

    index: int
    shape: tuple[int, ...]
    token_dim: int | None  # None: a plain full copy
    rows: int
    inner: int
    axes: tuple[Axis, ...]
    block: int
    wide: bool  # int64 indexing: some offset or element count passes int32
    aligned: bool  # the source pointer is 16-byte aligned (Triton specializes on it)
    dynamic: tuple[int, ...]  # source dims whose strides are kernel arguments
    baked: tuple[tuple[int, int], ...]  # (dim, source stride) baked into the kernel, for every dim it steps

    @property
    def token(self) -> bool:
        return self.token_dim is not None

    @property
    def empty(self) -> bool:
        return self.inner == 0 or self.rows == 0

    def describe(self) -> str:
        axes = ", ".join(f"{'b' if a.token else a.size}:{a.dst_stride}/{_stride(a.src_stride)}"
                         for a in self.axes)
        return f"tensor {self.index}: axes (size:dst stride/src stride) [{axes}], block {self.block}"


def plan_tensor(
    index: int,
    shape: Sequence[int],
    dst_strides: Sequence[int],
    token_dim: int | None,
    itemsize: int,
    src_strides: Sequence[int] | None,
    aligned: bool,
) -> TensorPlan:
    """The plan of one tensor. ``src_strides``: the source's strides baked into the kernel (one per dim;
    entries of dims the copy never steps along are ignored), or None to read them at run time."""
    kept = [j for j in range(len(shape)) if shape[j] != 1 or j == token_dim]
    kept.sort(key=lambda j: (-dst_strides[j], j))
    axes: list[Axis] = []
    for j in kept:
        src = None if src_strides is None else src_strides[j]
        axis = Axis(shape[j], dst_strides[j], src, j, j == token_dim)
        outer = axes[-1] if axes else None
        if (outer is not None and src_strides is not None and not outer.token and not axis.token
                and outer.dst_stride == axis.dst_stride * axis.size
                and outer.src_stride == src * axis.size):  # type: ignore[operator]
            axes[-1] = Axis(outer.size * axis.size, axis.dst_stride, src, j, False)
        else:
            axes.append(axis)
    rows = shape[token_dim] if token_dim is not None else 1
    inner = 1
    for j, size in enumerate(shape):
        if j != token_dim:
            inner *= size
    count = rows * inner
    block = max(MIN_BLOCK, min(BLOCK_BYTES // itemsize, _next_pow2(count)))
    dst_span = sum((a.size - 1) * a.dst_stride for a in axes)
    src_span = sum((a.size - 1) * abs(a.src_stride or 0) for a in axes)
    wide = max(count + block, dst_span, src_span) > INT32_LIMIT
    dynamic = tuple(a.dim for a in axes) if src_strides is None else ()
    baked = () if src_strides is None else tuple(sorted((j, src_strides[j]) for j in kept))
    return TensorPlan(index, tuple(shape), token_dim, rows, inner, tuple(axes), block, wide, aligned, dynamic,
                      baked)


def _stride(stride: int | None) -> str:
    return "?" if stride is None else str(stride)


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


# ----------------------------------------------------------------------------------- the kernel
def _params(p: TensorPlan) -> list[str]:
    i, int_t = p.index, "tl.int64" if p.rows > INT32_LIMIT else "tl.int32"
    names = [f"d{i}", f"s{i}"]
    if p.token:
        names += [f"n{i}: {int_t}", f"b{i}: {int_t}"]
    return names + [f"st{i}_{d}: tl.int64" for d in p.dynamic]


def _tensor_body(p: TensorPlan, start: str | None) -> list[str]:
    """The lines copying tensor ``p.index`` in the programs ``[start, end<i>)`` (locals suffixed with the
    tensor's index: each ``if`` block has its own)."""
    i = p.index
    b = f"b{i}.to(tl.int64)" if p.wide and p.token else f"b{i}"
    total = (b if p.inner == 1 else f"{b} * {p.inner}") if p.token else str(p.inner)
    # Not tl.cdiv: Triton's own jit functions fail under the interpreter unless TRITON_INTERPRET was set
    # before triton was imported.
    blocks = f"{f'{start} + ' if start else ''}({total} + {p.block - 1}) // {p.block}"
    lines = [f"    # {p.describe()}", f"    end{i} = {blocks}"]
    lines.append(f"    if (pid >= {start}) & (pid < end{i}):" if start else f"    if pid < end{i}:")
    q = f"(pid - {start})" if start else "pid"
    if p.wide:
        q = f"{q}.to(tl.int64)"
    e, r = f"e{i}", f"r{i}"
    body = [f"{e} = {q} * {p.block} + tl.arange(0, {p.block})"]
    index: dict[int, str] = {}
    if p.axes:
        body.append(f"{r} = {e}")
        for k in range(len(p.axes) - 1, 0, -1):
            size = f"b{i}" if p.axes[k].token else str(p.axes[k].size)
            index[k] = f"x{i}_{k}"
            body += [f"{index[k]} = {r} % {size}", f"{r} = {r} // {size}"]
        index[0] = r
    dst_terms = [_term(index[k], a.dst_stride) for k, a in enumerate(p.axes)]
    src_terms = [_term(index[k], f"st{i}_{a.dim}" if a.src_stride is None else a.src_stride)
                 for k, a in enumerate(p.axes)]
    body.append(f"m{i} = {e} < {total}")
    load_mask = f"m{i}"
    if p.token:
        t = next(index[k] for k, a in enumerate(p.axes) if a.token)
        load_mask = f"m{i} & ({t} < n{i})"
    body += [f"v{i} = tl.load(s{i} + ({_sum(src_terms, e)}), mask={load_mask}, other=0)",
             f"tl.store(d{i} + ({_sum(dst_terms, e)}), v{i}, mask=m{i})"]
    return lines + [f"        {line}" for line in body]


def _term(index: str, stride: int | str) -> str | None:
    if stride == 0:
        return None
    return index if stride == 1 else f"{index} * {stride}"


def _sum(terms: Sequence[str | None], e: str) -> str:
    kept = [t for t in terms if t is not None]
    return " + ".join(kept) if kept else f"{e} * 0"  # a block of offsets, all 0


def kernel_source(plans: Sequence[TensorPlan]) -> str:
    """The Triton source of one kernel copying every non-empty plan (one ``if`` per tensor over its range of
    program ids), or "" when every plan is empty (nothing to launch)."""
    live = [p for p in plans if not p.empty]
    if not live:
        return ""
    params = [name for p in live for name in _params(p)]
    no_spec = [n.split(":")[0] for n in params if ":" in n]
    no_align = [f"s{p.index}" for p in live if not p.aligned]
    decorator = f"@triton.jit(do_not_specialize={no_spec!r}"
    decorator += f", do_not_specialize_on_alignment={no_align!r})" if no_align else ")"
    lines = ['"""Generated by ppcompile.runtime.fused_copy_codegen: copies the live rows of each source into',
             'its static buffer and zeroes the padding rows up to the bucket, all tensors in one launch."""',
             "import triton", "import triton.language as tl", "", "", decorator,
             f"def {KERNEL_NAME}({', '.join(params)}):", "    pid = tl.program_id(0)"]
    start = None
    for p in live:
        lines += _tensor_body(p, start)
        start = f"end{p.index}"
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------- the host side
def host_source(plans: Sequence[TensorPlan], direct: bool, checked: bool, guard_device: bool) -> str:
    """The host function ``row_copy(srcs, ns, bs)`` for ``plans`` (names it reads: see
    ``fused_copy_triton.TritonRowCopier``). ``checked``: validate the sources and test that each still has the
    layout its plan baked (else hand the call to ``slow``); unchecked, it trusts a caller that did.
    ``direct``: launch through the compiled kernel's launcher with raw pointers (``run``, ``FN``,
    ``META``, ``stream``); else through ``run(grid, *args)`` with tensors (the Triton interpreter).
    ``guard_device``: hand the call to ``on_device`` when the current CUDA device is not the buffers'."""
    k = len(plans)
    lines = ["def row_copy(srcs, ns, bs):"]
    if guard_device:
        lines += ["    if current_device() != DEV:", "        return on_device(srcs, ns, bs)"]
    if checked:
        lines += [f"    if len(srcs) != {k} or len(ns) != {k} or len(bs) != {k}:",
                  "        bad_count(srcs, ns, bs)"]
    if k:
        lines += [f"    {', '.join(f'{x}{p.index}' for p in plans)}, = {src}"
                  for x, src in (("s", "srcs"), ("n", "ns"), ("b", "bs"))]
    args: list[str] = []
    grid: list[str] = []
    fixed = 0
    for p in plans:
        i = p.index
        if checked:
            lines += _validate(p)
        if p.empty:
            continue
        lines.append(f"    p{i} = s{i}.data_ptr()")
        if p.dynamic:
            lines.append(f"    st{i} = s{i}.stride()")
        if checked:
            lines += _layout_check(p)
        args += [f"D{i}", f"p{i}" if direct else f"s{i}.view(I{i})"]
        if p.token:
            args += [f"n{i}", f"b{i}"]
            rows = f"b{i}" if p.inner == 1 else f"b{i} * {p.inner}"
            grid.append(f"({rows} + {p.block - 1}) // {p.block}")
        else:
            fixed += -(-p.inner // p.block)
        args += [f"st{i}[{d}]" for d in p.dynamic]
    if args:
        if fixed:
            grid.append(str(fixed))
        lines.append(f"    grid = {' + '.join(grid)}")
        launch = ("run(grid, 1, 1, stream(DEV), FN, META, None, None, None, " if direct else "run(grid, ")
        lines += ["    if grid:", f"        {launch}{', '.join(args)})"]
    return "\n".join(lines) + "\n"


def _validate(p: TensorPlan) -> list[str]:
    """Lines raising (through ``bad``) unless source ``i`` has the buffer's dtype, device and shape (``n``
    rows along the token dim) and ``0 <= n <= b <= rows``."""
    i, s = p.index, f"s{p.index}"
    conds = [f"{s}.dtype is not dtype_{i}", f"len(z) != {len(p.shape)}"]
    conds += [f"z[{d}] != {f'n{i}' if d == p.token_dim else size}" for d, size in enumerate(p.shape)]
    if p.token:
        conds.append(f"not 0 <= n{i} <= b{i} <= {p.rows}")
    conds.append(f"{s}.get_device() != DEV")
    return [f"    z = {s}.shape", f"    if {' or '.join(conds)}:", f"        bad({i}, {s}, n{i}, b{i})"]


def _layout_check(p: TensorPlan) -> list[str]:
    """Lines sending the call to ``slow`` when the source's layout differs from what ``p`` baked in, along a
    dim the copy steps (a token dim of n <= 1 steps nowhere, nor does an empty copy)."""
    i = p.index
    conds = []
    if p.aligned:
        conds.append(f"p{i} & 15")
    for d, stride in p.baked:
        c = f"st[{d}] != {stride}"
        conds.append(f"(n{i} > 1 and {c})" if d == p.token_dim else c)
    if not conds:
        return []
    lines = []
    body = f"if {' or '.join(conds)}:"
    if p.baked:
        lines.append(f"st = s{i}.stride()")
    lines += [body, "    return slow(srcs, ns, bs)"]
    if p.token:
        return [f"    if n{i}:"] + [f"        {line}" for line in lines]
    return [f"    {line}" for line in lines]


# ----------------------------------------------------------------------------------- loading
_KERNELS: dict[tuple[str, bool], Any] = {}


def load_kernel(source: str, cache_dir: str, interpret: bool) -> Any:
    """The ``triton.jit`` function of ``source`` (written to ``cache_dir`` and imported: Triton reads a
    kernel's source from its file). One per source and interpreter setting, process-wide: Triton reads
    ``TRITON_INTERPRET`` when the module runs its decorator."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:24]
    key = (digest, interpret)
    kernel = _KERNELS.get(key)
    if kernel is not None:
        return kernel
    import triton

    knobs = getattr(triton, "knobs", None)  # Triton 3.4+
    if bool(knobs is not None and knobs.runtime.interpret) != interpret:
        raise RuntimeError(f"row copier: made {'with' if interpret else 'without'} Triton's interpreter, but "
                           "TRITON_INTERPRET changed before its kernel was built; keep it as it was")
    path = os.path.join(_kernel_folder(cache_dir), f"{KERNEL_NAME}_{digest}.py")
    if _read(path) != source:  # absent, or not what this source writes: never run a file as found
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)  # atomic: another process may write the same file
    spec = importlib.util.spec_from_file_location(f"ppcompile_fused_copy_{digest}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel = _KERNELS[key] = getattr(module, KERNEL_NAME)
    return kernel


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


_PRIVATE: dict[str, str] = {}  # cache dir -> the private folder used instead of its untrusted one


def _kernel_folder(cache_dir: str) -> str:
    """``<cache_dir>/fused_copy`` (made private to this user), or, when another user owns it or may write
    it, a private folder of this process's (with a warning): a kernel file is imported, so it runs."""
    if cache_dir in _PRIVATE:
        return _PRIVATE[cache_dir]
    folder = os.path.join(cache_dir, "fused_copy")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    why = untrusted_reason(folder)
    if why is None:
        return folder
    private = _PRIVATE[cache_dir] = tempfile.mkdtemp(prefix="ppcompile-fused-copy-")
    log.warning("row copier: %s, so its kernels are written to %s instead (make %s private to this user, "
                "`chmod -R go-w`)", why, private, folder)
    return private

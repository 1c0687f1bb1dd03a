"""The Triton row copier: one launch of a generated kernel per call (:mod:`ppcompile.runtime.fused_copy`
makes it; :mod:`ppcompile.runtime.fused_copy_codegen` writes the kernel and the host function it binds)::

    copier = make_row_copier([hidden_buf, positions_buf], dims=[0, 0], kernel="triton")
    copier([hidden, positions], ns=[n, n], bs=[b, b])   # first call: builds the kernel (compiles == 1)
    copier.launch_path   # "direct" on CUDA: the compiled kernel's launcher with raw pointers

A source whose layout differs from the one baked in (along a dim the copy steps: a new alignment, or
strides that change with ``n``, like a ``[3, n]`` source with token dim 1) sends the call to a slow path,
which records it and builds the kernel for it (that source's strides become kernel arguments once they
have changed). A copier so compiles a few kernels at most, during its first calls; ``compiles`` counts them.
On the Triton interpreter, or a Triton whose compiled kernels lack the launcher this binds, the same host
code launches through Triton's own dispatch (``launch_path`` says which).
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
from ppcompile.runtime.fused_copy_base import INT_TYPES, Buffer, RowCopier, bad, bad_count, check_sources

__all__ = ["NUM_WARPS", "TritonRowCopier"]

log = logging.getLogger(__name__)

NUM_WARPS = 4


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

    def __init__(self, buffers: tuple[Buffer, ...], interpret: bool) -> None:
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
                                 "bad_count": functools.partial(bad_count, len(self._buffers))}
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


def _bad_by_index(buffers: Sequence[Buffer], i: int, src: Any, n: int, b: int) -> None:
    bad(buffers[i], src, n, b)


def _launch_jit(kernel: Any, grid: int, *args: Any) -> None:
    kernel[(grid,)](*args, num_warps=NUM_WARPS)


def _exec(source: str, names: dict[str, Any]) -> Callable[..., None]:
    scope = dict(names)
    exec(compile(source, "<ppcompile row_copy>", "exec"), scope)
    fn: Callable[..., None] = scope["row_copy"]
    fn.source = source  # type: ignore[attr-defined]
    return fn

"""Executors: how a graph segment is captured for a bucket and replayed.

All three share one interface, so the runtime's data path (static buffers, copy-in, bridges, trims) is
the same whichever runs the graphs:

* ``CudaGraphExecutor``: one ``CUDAGraph`` per (segment, bucket) in one shared memory pool, through the
  ``CudaApi`` it is given (``cuda_api.py``); warm-ups on a side stream; strong references to every tensor
  a graph reads except graph outputs: once a bucket is captured, its outputs are held through non-owning
  tensors (vLLM's weak references), so their blocks go back to the pool and the next (smaller) bucket's
  capture reuses them. Graph memory is then about the largest bucket's, not the sum over buckets; a replay
  overwrites other buckets' outputs, which the runtime never reads across calls (outputs last until the
  next call).
* ``EmulatedGraphExecutor``: a graph's semantics without a GPU. Capture binds the segment to the exact
  input tensors and allocates its outputs once; replay reads only those inputs and writes only into
  those outputs. A runtime that forgets a copy-in, or hands out an output a later call overwrites,
  computes wrong answers here exactly as it would on a GPU. Given the output shapes of each bucket
  (``shapes``), the buckets of one segment share output memory, as graphs in one pool do when their
  outputs are not held: the segment runs once, at its first (largest) bucket, and smaller buckets
  capture leading views of those outputs, so capture costs one run per segment instead of one per
  (segment, bucket), and any bucket's replay overwrites the others' outputs. A view must also have the
  bucket's own strides (``strides``): an output laid out with the token dim inner (``[H, T]`` row-major)
  keeps the largest bucket's row stride in a view, which a segment compiled for the bucket's strides
  would misread, so that output gets its own memory per bucket (its segment runs at each bucket).
* ``EagerExecutor``: runs the segment on whatever static tensors it is given each call and returns
  fresh outputs: same data movement, no fixed addresses (isolates graph bugs from buffer bugs).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
import gc
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import torch

from ppcompile.runtime.cuda_api import TORCH_CUDA, CudaApi
from ppcompile.runtime.group_agreement import LOCAL, Agreement
from ppcompile.runtime.static_buffers import strides_match
from ppcompile.torch_internals import has_internal_overlap, storage_from_data_pointer

_T = TypeVar("_T")

__all__ = ["EXECUTORS", "CudaGraphExecutor", "EagerExecutor", "EmulatedGraphExecutor", "ExecutorFactory",
           "GraphExecutor", "ReplayAddressError", "make_executor", "non_owning"]

SegmentFn = Callable[..., Sequence[Any]]
Key = tuple[int, int]  # (segment index, bucket)
# Per output of a segment at one bucket: a tensor's shape, a number's value, or None (not derivable).
OutputShapes = Sequence[tuple[int, ...] | int | None]
OutputStrides = Sequence[tuple[int, ...] | None]


class ReplayAddressError(RuntimeError):
    """A graph was asked to replay with inputs other than the tensors it captured (``debug=True``)."""


@dataclasses.dataclass
class _Captured:
    fn: SegmentFn
    args: tuple[Any, ...]  # strong references: a graph must never outlive what it reads
    outputs: tuple[Any, ...]
    graph: Any = None


class GraphExecutor(abc.ABC):
    """Captures (segment, bucket) graphs and replays them. Each capture is settled with ``agreement``
    (a TP group's ranks learn whether all of them captured) before it runs anything after the capture."""

    name: str = ""
    binds_inputs: bool = True  # replay ignores the args it is given and reads the captured ones
    shares_outputs: bool = False  # the buckets of a segment write their outputs into shared memory

    def __init__(self, debug: bool = False, agreement: Agreement = LOCAL) -> None:
        self.debug = debug
        self.agreement = agreement
        self._captured: dict[Key, _Captured] = {}

    def _settled(self, run: Callable[[], _T]) -> _T:
        """``run()``, settled with the group whether it fails or not (see :meth:`Agreement.settle`)."""
        try:
            result = run()
        except Exception as e:
            self.agreement.settle(e)
            raise
        self.agreement.settle(None)
        return result

    @abc.abstractmethod
    def capture(
        self, key: Key, fn: SegmentFn, args: Sequence[Any], shapes: OutputShapes | None = None,
        strides: OutputStrides | None = None,
    ) -> tuple[Any, ...]:
        """Captures ``fn(*args)`` for ``key``; returns the outputs replays will write into.
        ``shapes`` / ``strides``: what each output is at this bucket (a tensor's shape and strides, a
        number's value), when the runtime can tell (see the module docstring); an executor may ignore
        them."""

    @abc.abstractmethod
    def replay(self, key: Key, args: Sequence[Any]) -> tuple[Any, ...]:
        """Replays ``key``; returns its outputs."""

    def bound_replay(self, key: Key) -> Callable[[], Any]:
        """``key``'s replay bound once, called with no arguments (an executor that binds inputs)."""
        return functools.partial(self.replay, key, ())

    def capture_session(self) -> contextlib.AbstractContextManager[None]:
        """Wraps a run of captures (every bucket of a stage)."""
        return contextlib.nullcontext()

    def trial(self, run: Callable[[], Any]) -> None:
        """Runs ``run`` under the conditions of a capture, keeping nothing (to find what fails in a
        segment whose capture failed); plain executors just run it."""
        run()

    def bucket_captured(self, bucket: int) -> dict[int, Any]:
        """Every graph segment of ``bucket`` is captured. Returns replacements, by ``id``, for graph
        outputs the runtime still holds (it must hold those instead); none by default."""
        return {}

    def num_captured(self) -> int:
        return len(self._captured)

    def release(self) -> None:
        """Drops every captured graph and what it holds (after a failed capture: graphs are off)."""
        self._captured.clear()

    def forget(self, bucket: int) -> None:
        """Drops the graphs captured for ``bucket`` (its capture failed part way; it runs eagerly)."""
        for key in [k for k in self._captured if k[1] == bucket]:
            del self._captured[key]

    def _check_addresses(self, key: Key, args: Sequence[Any]) -> None:
        captured = self._captured[key].args
        for i, (got, want) in enumerate(zip(args, captured)):
            if isinstance(want, torch.Tensor) and (
                got is not want
                and (not isinstance(got, torch.Tensor) or got.data_ptr() != want.data_ptr()
                     or got.shape != want.shape or got.stride() != want.stride())
            ):
                raise ReplayAddressError(
                    f"pp_breakable debug: segment {key[0]} at bucket {key[1]} was captured reading input "
                    f"{i} at address {want.data_ptr():#x} {tuple(want.shape)}, but replay got "
                    f"{got.data_ptr() if isinstance(got, torch.Tensor) else got!r}; a graph only ever "
                    "reads the tensors it captured"
                )


def _writable(value: Any) -> Any:
    """An output replays can copy into: a tensor whose elements share memory (``expand``'s stride 0)
    cannot be a copy destination, so it is captured as a dense copy (same values, own memory)."""
    if isinstance(value, torch.Tensor) and has_internal_overlap(value):
        return value.clone(memory_format=torch.contiguous_format)
    return value


def _storages(values: Sequence[Any]) -> list[int]:
    return [v.untyped_storage().data_ptr() for v in values if isinstance(v, torch.Tensor)]


def _leading_views(
    outputs: Sequence[Any], shapes: OutputShapes, strides: OutputStrides | None = None
) -> tuple[Any, ...] | None:
    """Views of ``outputs`` with ``shapes`` (each dim narrowed from the start), or None if one can't be,
    or if one would not have the given ``strides`` (a later segment compiled for a bucket's own strides
    must not read a larger bucket's view: [H, T] row-major keeps the larger T as its row stride)."""
    views: list[Any] = []
    for i, (out, shape) in enumerate(zip(outputs, shapes, strict=True)):
        if isinstance(out, torch.Tensor) and isinstance(shape, tuple) and len(shape) == out.dim():
            if any(n > m for n, m in zip(shape, out.shape)):
                return None
            for d, n in enumerate(shape):
                if n != out.shape[d]:
                    out = out.narrow(d, 0, n)
            want = strides[i] if strides is not None and i < len(strides) else None
            if want is not None and not strides_match(out.stride(), want, shape):
                return None
            views.append(out)
        elif isinstance(shape, int) and not isinstance(out, torch.Tensor):
            views.append(shape)
        else:
            return None
    return tuple(views)


class EmulatedGraphExecutor(GraphExecutor):
    """CPU emulation of CUDA-graph semantics (see module docstring)."""

    name = "emulate"
    shares_outputs = True

    def __init__(self, debug: bool = False, agreement: Agreement = LOCAL) -> None:
        super().__init__(debug, agreement)
        # Per segment: the outputs of its first capture, when later buckets may view them.
        self._shared: dict[int, tuple[Any, ...] | None] = {}

    def capture(
        self, key: Key, fn: SegmentFn, args: Sequence[Any], shapes: OutputShapes | None = None,
        strides: OutputStrides | None = None,
    ) -> tuple[Any, ...]:
        first = self._shared.get(key[0])
        if first is not None and shapes is not None:
            views = _leading_views(first, shapes, strides)
            if views is not None:
                self.agreement.settle(None)  # nothing ran: every rank of the group takes this path alike
                self._captured[key] = _Captured(fn, tuple(args), views)
                return views
        outputs = self._settled(lambda: tuple(_writable(o) for o in fn(*args)))
        self._captured[key] = _Captured(fn, tuple(args), outputs)
        if shapes is not None and key[0] not in self._shared:
            self._shared[key[0]] = outputs if self._shareable(outputs, args, shapes) else None
        return outputs

    @staticmethod
    def _shareable(outputs: Sequence[Any], args: Sequence[Any], shapes: OutputShapes) -> bool:
        """Outputs later buckets may view: as the shapes said, and no memory shared with an input or
        with each other (such a segment runs at every bucket, keeping its aliases exact)."""
        if _leading_views(outputs, shapes) is None:
            return False
        for out, shape in zip(outputs, shapes):
            if (tuple(out.shape) if isinstance(out, torch.Tensor) else out) != shape:
                return False
        mine = _storages(outputs)
        return len(set(mine)) == len(mine) and not set(mine) & set(_storages(args))

    def release(self) -> None:
        super().release()
        self._shared.clear()

    def replay(self, key: Key, args: Sequence[Any]) -> tuple[Any, ...]:
        if self.debug:
            self._check_addresses(key, args)
        return _rerun(self._captured[key])

    def bound_replay(self, key: Key) -> Callable[[], Any]:
        return functools.partial(_rerun, self._captured[key]) if not self.debug else super().bound_replay(key)


def _rerun(c: _Captured) -> tuple[Any, ...]:
    """An emulated replay: the segment on its captured inputs, its results copied into its outputs."""
    for out, res in zip(c.outputs, c.fn(*c.args)):
        if isinstance(out, torch.Tensor) and out is not res:
            out.copy_(res)
    return c.outputs


class EagerExecutor(GraphExecutor):
    """No graphs: runs the segment on the given static tensors each call; outputs are fresh."""

    name = "eager"
    binds_inputs = False

    def capture(self, key: Key, fn: SegmentFn, args: Sequence[Any], shapes: OutputShapes | None = None,
                strides: OutputStrides | None = None) -> tuple[Any, ...]:
        self._captured[key] = _Captured(fn, (), ())
        return self._settled(lambda: tuple(fn(*args)))

    def replay(self, key: Key, args: Sequence[Any]) -> tuple[Any, ...]:
        return tuple(self._captured[key].fn(*args))


def non_owning(t: torch.Tensor) -> torch.Tensor:
    """A tensor on ``t``'s memory that does not keep it allocated (a weak reference, as vLLM's
    ``weak_ref_tensor``); made in ``t``'s inference mode, so Dynamo sees the same kind of tensor."""
    storage = t.untyped_storage()
    view = storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    with torch.inference_mode(t.is_inference()):
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(
            view, t.storage_offset(), t.shape, t.stride())


class CudaGraphExecutor(GraphExecutor):
    """CUDA graphs in one shared pool on the stage's device, the largest bucket captured first.

    Per (segment, bucket): warm-ups on the side stream, the capture on the same stream, then one replay.
    A capture records kernels without running them, so until that replay the segment's outputs hold
    whatever the pool's memory held; the next segment's warm-ups read them, and an index read from
    uninitialised memory (top-k ids, slot ids crossing segments) faults the device, an error that kills
    the process. Captures do not synchronize or flush the allocator's cache each (``torch.cuda.graph``
    does, torch_internals.cuda_graph_capture): a run of captures flushes once, at its start. Every CUDA
    call goes through ``cuda`` (``cuda_api.CudaApi``; default ``torch.cuda``).
    """

    name = "cuda"
    shares_outputs = True

    def __init__(self, debug: bool = False, num_warmup: int = 2, device: torch.device | None = None,
                 agreement: Agreement = LOCAL, cuda: CudaApi = TORCH_CUDA) -> None:
        super().__init__(debug, agreement)
        self.num_warmup = num_warmup
        self.cuda = cuda
        # The stage's device, not whichever is current when the stage is first called.
        self.device = torch.device("cuda", cuda.current_device()) if device is None else device
        with cuda.device(self.device):
            self.pool = cuda.graph_pool_handle()
            self._stream = cuda.Stream()

    @contextlib.contextmanager
    def capture_session(self) -> Iterator[None]:
        """A run of captures (every bucket of a stage) on the stage's device: garbage collected and the
        allocator's cache flushed once at the start (blocks cached by eager work go back, so the graph
        pool can take that memory), then the collector kept off: with a graph per (segment, bucket),
        collections in between would dominate capture time (vLLM and SGLang freeze it too)."""
        with self.cuda.device(self.device):
            self.cuda.synchronize()
            gc.collect()
            self.cuda.empty_cache()
            was_enabled = gc.isenabled()
            gc.disable()
            try:
                yield
            finally:
                if was_enabled:
                    gc.enable()

    def capture(
        self, key: Key, fn: SegmentFn, args: Sequence[Any], shapes: OutputShapes | None = None,
        strides: OutputStrides | None = None,
    ) -> tuple[Any, ...]:
        cuda, stream = self.cuda, self._stream
        graph = cuda.CUDAGraph()

        def warm_up_and_capture() -> tuple[Any, ...]:
            with cuda.stream(stream):
                for _ in range(self.num_warmup):
                    fn(*args)
            with cuda.capture(graph, self.pool, stream):
                return tuple(fn(*args))

        with cuda.device(self.device):
            current = cuda.current_stream()
            stream.wait_stream(current)
            # Settled before the replay, which runs the segment's collectives (a capture only records).
            outputs = self._settled(warm_up_and_capture)
            with cuda.stream(stream):
                graph.replay()  # the outputs get values before anything reads them (see the class doc)
            current.wait_stream(stream)
        self._captured[key] = _Captured(fn, tuple(args), outputs, graph)
        return outputs

    def trial(self, run: Callable[[], Any]) -> None:
        """Runs ``run`` as a capture would (its failure diagnosed: ``capture_diagnosis``), into a graph
        that is dropped."""
        with self.cuda.device(self.device):
            with self.cuda.capture(self.cuda.CUDAGraph(), self.pool, self._stream):
                run()
            self.cuda.current_stream().wait_stream(self._stream)

    def bucket_captured(self, bucket: int) -> dict[int, Any]:
        """Holds ``bucket``'s graph outputs (and later graphs' reads of them) through non-owning
        tensors; once the runtime swaps its own references, their blocks return to the pool. The
        pool keeps them reserved while its graphs live, so the non-owning tensors stay valid."""
        mine = [c for key, c in self._captured.items() if key[1] == bucket]
        swap: dict[int, Any] = {}
        for c in mine:
            for o in c.outputs:
                if isinstance(o, torch.Tensor) and o.numel() and id(o) not in swap:
                    swap[id(o)] = non_owning(o)
        for c in mine:
            c.outputs = tuple(swap.get(id(o), o) for o in c.outputs)
            c.args = tuple(swap.get(id(a), a) if isinstance(a, torch.Tensor) else a for a in c.args)
        return swap

    def replay(self, key: Key, args: Sequence[Any]) -> tuple[Any, ...]:
        if self.debug:
            self._check_addresses(key, args)
        c = self._captured[key]
        c.graph.replay()
        return c.outputs

    def bound_replay(self, key: Key) -> Callable[[], Any]:
        return self._captured[key].graph.replay if not self.debug else super().bound_replay(key)


EXECUTORS: dict[str, type[GraphExecutor]] = {
    "cuda": CudaGraphExecutor, "emulate": EmulatedGraphExecutor, "eager": EagerExecutor}
"""The executor class of each resolved graph mode (``none`` has none: it captures nothing)."""


class ExecutorFactory(Protocol):
    """Makes each stage instance's executor as :func:`make_executor` (the default) does; a runtime takes
    another (``StageRuntime(..., executor=f)``, ``runtime.use_executor(f)``), e.g. to inject faults."""

    def __call__(self, mode: str, debug: bool, device: torch.device | None,
                 agreement: Agreement) -> GraphExecutor: ...


def make_executor(mode: str, debug: bool, device: torch.device | None = None,
                  agreement: Agreement = LOCAL, cuda: CudaApi = TORCH_CUDA) -> GraphExecutor:
    """The executor for a resolved graph mode: ``cuda`` (its graphs on ``device``, None: the current
    CUDA device, through the CUDA API ``cuda``), ``emulate`` or ``eager``; settled with ``agreement``."""
    if mode == "cuda":
        return CudaGraphExecutor(debug, device=device, agreement=agreement, cuda=cuda)
    cls = EXECUTORS.get(mode)
    if cls is None:
        raise ValueError(f"pp_breakable: no executor for graph mode {mode!r}")
    return cls(debug, agreement)

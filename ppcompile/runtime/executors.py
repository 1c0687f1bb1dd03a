"""Executors: how a graph segment is captured for a bucket and replayed.

All three share one interface, so the runtime's data path (static buffers, copy-in, bridges, trims) is
the same whichever runs the graphs:

* ``CudaGraphExecutor``: one ``torch.cuda.CUDAGraph`` per (segment, bucket) in one shared memory pool;
  warm-up runs on a side stream before capture; strong references to every tensor a graph reads.
* ``EmulatedGraphExecutor``: a graph's semantics without a GPU. Capture binds the segment to the exact
  input tensors and allocates its outputs once; replay reads only those inputs and writes only into
  those outputs. A runtime that forgets a copy-in, or hands out an output a later call overwrites,
  computes wrong answers here exactly as it would on a GPU.
* ``EagerExecutor``: runs the segment on whatever static tensors it is given each call and returns
  fresh outputs: same data movement, no fixed addresses (isolates graph bugs from buffer bugs).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import gc
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = [
    "CudaGraphExecutor",
    "EagerExecutor",
    "EmulatedGraphExecutor",
    "GraphExecutor",
    "ReplayAddressError",
    "make_executor",
]

SegmentFn = Callable[..., Sequence[Any]]
Key = tuple[int, int]  # (segment index, bucket)


class ReplayAddressError(RuntimeError):
    """A graph was asked to replay with inputs other than the tensors it captured (``debug=True``)."""


@dataclasses.dataclass
class _Captured:
    fn: SegmentFn
    args: tuple[Any, ...]  # strong references: a graph must never outlive what it reads
    outputs: tuple[Any, ...]
    graph: Any = None


class GraphExecutor(abc.ABC):
    """Captures (segment, bucket) graphs and replays them."""

    name: str = ""
    binds_inputs: bool = True  # replay ignores the args it is given and reads the captured ones

    def __init__(self, debug: bool = False) -> None:
        self.debug = debug
        self._captured: dict[Key, _Captured] = {}

    @abc.abstractmethod
    def capture(self, key: Key, fn: SegmentFn, args: Sequence[Any]) -> tuple[Any, ...]:
        """Captures ``fn(*args)`` for ``key``; returns the outputs replays will write into."""

    @abc.abstractmethod
    def replay(self, key: Key, args: Sequence[Any]) -> tuple[Any, ...]:
        """Replays ``key``; returns its outputs."""

    def capture_session(self) -> contextlib.AbstractContextManager[None]:
        """Wraps a run of captures (every bucket of a stage)."""
        return contextlib.nullcontext()

    def num_captured(self) -> int:
        return len(self._captured)

    def release(self) -> None:
        """Drops every captured graph and what it holds (after a failed capture: graphs are off)."""
        self._captured.clear()

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
    if isinstance(value, torch.Tensor) and torch._debug_has_internal_overlap(value) == 1:
        return value.clone(memory_format=torch.contiguous_format)
    return value


class EmulatedGraphExecutor(GraphExecutor):
    """CPU emulation of CUDA-graph semantics (see module docstring)."""

    name = "emulate"

    def capture(self, key: Key, fn: SegmentFn, args: Sequence[Any]) -> tuple[Any, ...]:
        outputs = tuple(_writable(o) for o in fn(*args))
        self._captured[key] = _Captured(fn, tuple(args), outputs)
        return outputs

    def replay(self, key: Key, args: Sequence[Any]) -> tuple[Any, ...]:
        if self.debug:
            self._check_addresses(key, args)
        c = self._captured[key]
        results = c.fn(*c.args)
        for out, res in zip(c.outputs, results):
            if isinstance(out, torch.Tensor) and out is not res:
                out.copy_(res)
        return c.outputs


class EagerExecutor(GraphExecutor):
    """No graphs: runs the segment on the given static tensors each call; outputs are fresh."""

    name = "eager"
    binds_inputs = False

    def capture(self, key: Key, fn: SegmentFn, args: Sequence[Any]) -> tuple[Any, ...]:
        self._captured[key] = _Captured(fn, (), ())
        return tuple(fn(*args))

    def replay(self, key: Key, args: Sequence[Any]) -> tuple[Any, ...]:
        return tuple(self._captured[key].fn(*args))


class CudaGraphExecutor(GraphExecutor):
    """CUDA graphs in one shared pool; the runtime captures the largest bucket first."""

    name = "cuda"

    def __init__(self, debug: bool = False, num_warmup: int = 2) -> None:
        super().__init__(debug)
        self.num_warmup = num_warmup
        self.pool = torch.cuda.graph_pool_handle()
        self._stream: Any = None

    @contextlib.contextmanager
    def capture_session(self) -> Iterator[None]:
        """Collects garbage once, then keeps the collector off for the whole run of captures: with a
        graph per (segment, bucket), collections in between would dominate capture time (vLLM and
        SGLang freeze the collector during capture too)."""
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            if was_enabled:
                gc.enable()

    def capture(self, key: Key, fn: SegmentFn, args: Sequence[Any]) -> tuple[Any, ...]:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.num_warmup):
                fn(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            outputs = tuple(fn(*args))
        self._captured[key] = _Captured(fn, tuple(args), outputs, graph)
        return outputs

    def replay(self, key: Key, args: Sequence[Any]) -> tuple[Any, ...]:
        if self.debug:
            self._check_addresses(key, args)
        c = self._captured[key]
        c.graph.replay()
        return c.outputs


def make_executor(mode: str, debug: bool) -> GraphExecutor:
    """The executor for a resolved graph mode: ``cuda``, ``emulate`` or ``eager``."""
    if mode == "cuda":
        return CudaGraphExecutor(debug)
    if mode == "emulate":
        return EmulatedGraphExecutor(debug)
    if mode == "eager":
        return EagerExecutor(debug)
    raise ValueError(f"pp_breakable: no executor for graph mode {mode!r}")

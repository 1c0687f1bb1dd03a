"""A strict CUDA-capture double: torch's CUDA graph API on CPU tensors, with real capture's rules.

Handed to the executor as its CUDA API (``CudaGraphExecutor(cuda=strict_cuda.api)``; the ``strict_cuda``
fixture also makes it the executor factory of every stage the backend builds with ``graph_mode="emulate"``,
through ``runtime_helpers.executors_made_by``), it lets the CUDA path of the runtime (``CudaGraphExecutor``,
``StageInstance``, the generated per-call code) run in the CPU suite, holding it to what a GPU would.
Nothing of torch is patched: ``StrictCuda`` has ``torch.cuda``'s names (``Stream``, ``stream``,
``CUDAGraph``, ``graph``, ``Event``, ``synchronize``, ``empty_cache``, ...), for a test's segments to call.

* **A capture runs nothing.** Between ``capture_begin`` and ``capture_end`` every aten op is recorded, not
  run: a compute op's outputs are allocated from its meta kernel's shapes and strides and filled with
  garbage (NaN for floats, random bits for integers, as fresh pool memory holds), an in-place or ``out=``
  op writes nothing, a view op makes its view (it launches no kernel). Code that reads a capture's
  outputs before a replay (a warm-up of the next segment) reads garbage, as on a GPU, where an index
  read from it faults the device.
* **What real capture rejects raises**, naming the op: a host read of device memory
  (``_local_scalar_dense``: ``.item()``, ``bool(t)``), ops whose output size depends on
  the data (``nonzero``, ``masked_select``, ``unique``, ``bincount``, ``repeat_interleave`` without
  ``output_size``), RNG ops given their own generator, an allocation while the current stream is not the
  capture stream, and ``torch.cuda.synchronize``, ``empty_cache``, ``Event.query`` / ``synchronize``.
* **A replay runs the recorded ops in order**, each result written into the tensor the capture handed out
  (fixed addresses).

It counts what costs time on a GPU: cache flushes (``empty_cache``) and device syncs. What it cannot see:
work that does not dispatch through aten (Inductor's CPU kernels run at capture like plain code, so
Inductor segments are held to the rules only by their aten calls, and their replays would miss them:
use eager segments under the double) and copies from pageable host memory (on CPU every tensor is host
memory; the compile-time capture rules flag them, and the GPU tests run the real thing). ``.tolist()``
and ``.numpy()`` read memory without dispatching: a torch-function mode sees them while the double
captures, and they raise like a host read. Code that calls ``torch.cuda`` itself, not the API it was
given, is not seen. A ``torch.library.custom_op`` runs its Python implementation under the double, as
a GPU runs its kernels at capture, so its aten ops and host reads are held too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from runtime_helpers import executors_made_by
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ppcompile.runtime.cuda_api import CudaApi
from ppcompile.runtime.executors import GraphExecutor, make_executor
from ppcompile.runtime.group_agreement import Agreement

__all__ = ["CaptureViolation", "StrictCuda", "strict_cuda"]


class CaptureViolation(RuntimeError):
    """Something real CUDA graph capture rejects happened while capturing."""


# aten ops (by packet name) that real capture rejects, whatever their arguments, and why.
ILLEGAL = {
    "_local_scalar_dense": "reads a device value on the host (.item(), bool(t)): a sync",
    "item": "reads a device value on the host: a sync",
    "nonzero": "has an output size that depends on the data: a sync",
    "masked_select": "has an output size that depends on the data: a sync",
    "_unique2": "has an output size that depends on the data: a sync",
    "unique_dim": "has an output size that depends on the data: a sync",
    "unique_consecutive": "has an output size that depends on the data: a sync",
    "bincount": "has an output size that depends on the data: a sync",
}
GARBAGE_INT = 0x5A5A5A5A  # a byte pattern far out of any index range


def _packet(func: Any) -> str:
    return str(getattr(func, "_overloadpacket", func)).split("::")[-1].split(".")[-1]


def _violation(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    name = _packet(func)
    if name in ILLEGAL:
        return ILLEGAL[name]
    if name == "repeat_interleave" and isinstance(args[0] if args else None, torch.Tensor) and (
        kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None)
        and (isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor) or len(args) == 1)
    ):
        return "with tensor repeats and no output_size has an output size that depends on the data: a sync"
    if kwargs.get("generator") is not None:
        return "draws from its own generator, which is not registered with the capture"
    return None


def _host_scalar(t: Any) -> bool:
    """Whether ``t`` stands for host memory: how Dynamo passes a module's Python number (an RMSNorm's
    eps), a 0-d float64 or int64 CPU tensor that no capture made, which a CUDA stage reads on the host
    at capture (its value is baked into the graph). The double's one approximation of devices: every
    tensor is on the CPU here, so a 0-d float64/int64 tensor a model keeps on its device would pass."""
    return isinstance(t, torch.Tensor) and t.dim() == 0 and t.dtype in (torch.float64, torch.int64)


_HOST_READS = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy"}


class _HostReads(TorchFunctionMode):
    """``Tensor.tolist`` / ``numpy`` (which read memory without dispatching an aten op) raising as host
    reads while ``api`` captures."""

    def __init__(self, api: StrictCuda) -> None:
        super().__init__()
        self.api = api

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = _HOST_READS.get(func)
        t = args[0] if args else None
        if name is not None and not (
                _host_scalar(t) and t.untyped_storage().data_ptr() not in self.api.captured_memory):
            self.api.invalidated = True
            raise CaptureViolation(f"CUDA graph capture: Tensor.{name} reads a device value on the host "
                                   "(a sync); it cannot be captured")
        return func(*args, **(kwargs or {}))


def fill_garbage(t: torch.Tensor) -> None:
    """What fresh pool memory holds, as far as the values go: NaN floats, large integers, random bools."""
    with torch.no_grad():
        if t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        elif t.dtype == torch.bool:
            t.copy_(torch.randint(0, 2, t.shape, dtype=torch.bool))
        elif t.dtype in (torch.uint8, torch.int8):
            t.fill_(0x5A)
        elif t.dtype == torch.int16:
            t.fill_(0x5A5A)
        else:
            t.fill_(GARBAGE_INT)


def _writes(func: Any) -> list[tuple[int, str]]:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    return [(i, a.name) for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write]


def _is_view(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    return bool(schema is not None and schema.returns and all(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns))


def _composite(func: Any) -> bool:
    """Whether ``func`` is implemented by other aten ops (CompositeImplicitAutograd)."""
    name = getattr(func, "name", None)
    return callable(name) and torch._C._dispatch_has_kernel_for_dispatch_key(
        func.name(), "CompositeImplicitAutograd")


def _python_custom_op(func: Any) -> Any:
    """The ``torch.library.custom_op`` definition behind ``func``, if it is one."""
    from torch._library.custom_ops import OPDEFS

    name = getattr(getattr(func, "_overloadpacket", None), "_qualified_op_name", "")
    return None if name.startswith(("aten::", "prims::")) else OPDEFS.get(name)


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


@dataclasses.dataclass
class _Op:
    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: Any
    rerun_writes: bool  # in place: the replay writes its tensors; else results are copied into outputs


class _Capturing(TorchDispatchMode):
    """Records the aten ops of one capture without running them (see the module docstring)."""

    def __init__(self, api: StrictCuda, graph: StrictGraph) -> None:
        super().__init__()
        self.api = api
        self.graph = graph

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        why = _violation(func, tuple(args), kwargs)
        if (why is not None and _packet(func) in ("item", "_local_scalar_dense") and _host_scalar(args[0])
                and args[0].untyped_storage().data_ptr() not in self.api.captured_memory):
            return func(*args, **kwargs)  # a Python number Dynamo passes as a CPU tensor: baked in
        if why is not None:
            self.api.invalidated = True
            raise CaptureViolation(f"CUDA graph capture: {func} {why}; it cannot be captured")
        if _composite(func):  # contiguous, reshape, linear: may alias or compute; held as what they run
            with self:
                return func.decompose(*args, **kwargs)
        if _is_view(func):  # a view launches nothing: made now, the same view at every replay
            return func(*args, **kwargs)
        opdef = _python_custom_op(func)
        if opdef is not None:  # its implementation runs at capture on a GPU: its aten ops are held here
            with self:
                return opdef._init_fn(*args, **kwargs)
        if self.api.current_stream() is not self.graph.stream:
            self.api.invalidated = True
            raise CaptureViolation(
                f"CUDA graph capture: {func} runs on stream {self.api.current_stream().name} while stream "
                f"{self.graph.stream.name} captures (an allocation outside the capture stream)")
        written = _writes(func)
        if written:
            out = [args[i] if i < len(args) else kwargs.get(name) for i, name in written]
            self.graph.ops.append(_Op(func, tuple(args), kwargs, None, True))
            if not func._schema.returns:
                return None
            return out[0] if len(out) == 1 else tuple(out)
        outputs = self._allocate(func, args, kwargs)
        self.api.captured_memory.update(t.untyped_storage().data_ptr() for t in tree_flatten(outputs)[0]
                                        if isinstance(t, torch.Tensor))
        self.graph.ops.append(_Op(func, tuple(args), kwargs, outputs, False))
        return outputs

    @staticmethod
    def _allocate(func: Any, args: Any, kwargs: Any) -> Any:
        """Outputs of ``func``'s shapes and strides, garbage-filled, without running it (an op that has
        no meta kernel runs, and its outputs are overwritten)."""
        try:
            meta = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
            leaves, spec = tree_flatten(meta)
            device = next((a.device for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)),
                          kwargs.get("device") or torch.device("cpu"))
            real = [torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=device)
                    if isinstance(m, torch.Tensor) else m for m in leaves]
            result = tree_unflatten(real, spec)
        except (NotImplementedError, RuntimeError, TypeError):
            result = func(*args, **kwargs)
        for leaf in tree_flatten(result)[0]:
            if isinstance(leaf, torch.Tensor):
                fill_garbage(leaf)
        return result


class StrictStream:
    def __init__(self, api: StrictCuda, name: str) -> None:
        self.api = api
        self.name = name

    def wait_stream(self, other: StrictStream) -> None:
        self.api.events.append(f"{self.name}.wait_stream({other.name})")

    def synchronize(self) -> None:
        self.api.sync("Stream.synchronize")


class StrictEvent:
    def __init__(self, api: StrictCuda, *args: Any, **kwargs: Any) -> None:
        self.api = api

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        self.api.sync("Event.query")
        return True

    def synchronize(self) -> None:
        self.api.sync("Event.synchronize")


class StrictGraph:
    """``torch.cuda.CUDAGraph``: ``capture_begin`` / ``capture_end`` record, ``replay`` runs the record."""

    def __init__(self, api: StrictCuda) -> None:
        self.api = api
        self.ops: list[_Op] = []
        self.replays = 0
        self.pool: Any = None
        self.stream: StrictStream | None = None
        self._mode: _Capturing | None = None
        self._host_reads: _HostReads | None = None
        self._failed: BaseException | None = None
        api.graphs.append(self)

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        if self.api.capturing is not None:
            raise RuntimeError("CUDA graph capture: a capture is already in progress")
        self.pool, self.stream = pool, self.api.current_stream()
        self.api.capturing = self
        self.api.events.append("begin capture")
        self._mode = _Capturing(self.api, self)
        self._mode.__enter__()
        self._host_reads = _HostReads(self.api)
        self._host_reads.__enter__()

    def capture_end(self) -> None:
        assert self._mode is not None and self.api.capturing is self, "capture_end without capture_begin"
        assert self._host_reads is not None
        self._host_reads.__exit__(None, None, None)
        self._mode.__exit__(None, None, None)
        self._mode = self._host_reads = None
        self.api.capturing = None
        self.api.events.append("end capture")
        if self.api.invalidated:
            self.api.invalidated = False
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing "
                               "(the capture was invalidated)")

    def replay(self) -> None:
        if self.api.capturing is not None:
            raise CaptureViolation("CUDA graph capture: a graph replayed while another captures")
        self.replays += 1
        for op in self.ops:
            result = op.func(*op.args, **op.kwargs)
            if op.rerun_writes:
                continue
            for out, res in zip(tree_flatten(op.outputs)[0], tree_flatten(result)[0]):
                if isinstance(out, torch.Tensor) and out is not res:
                    out.copy_(res)


@dataclasses.dataclass
class StrictCuda:
    """The double's state: what was asked of the CUDA API, and what it counted."""

    events: list[str] = dataclasses.field(default_factory=list)
    graphs: list[StrictGraph] = dataclasses.field(default_factory=list)
    pools: list[Any] = dataclasses.field(default_factory=list)
    streams: list[StrictStream] = dataclasses.field(default_factory=list)
    devices: list[Any] = dataclasses.field(default_factory=list)  # ``torch.cuda.device`` entered with
    capturing: StrictGraph | None = None
    invalidated: bool = False  # a violation happened: capture_end raises, as on a GPU
    captured_memory: set[int] = dataclasses.field(default_factory=set)  # storages captures allocated
    flushes: int = 0  # empty_cache calls
    syncs: int = 0
    stream_stack: list[StrictStream] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.default = StrictStream(self, "default")
        self.api = CudaApi(self)  # what CudaGraphExecutor(cuda=...) takes: this double's calls, bound

    def current_stream(self, device: Any = None) -> StrictStream:
        return self.stream_stack[-1] if self.stream_stack else self.default

    def sync(self, what: str) -> None:
        if self.capturing is not None:
            self.invalidated = True
            raise CaptureViolation(f"CUDA graph capture: {what} synchronizes, which capture forbids")
        self.syncs += 1

    def empty_cache(self) -> None:
        if self.capturing is not None:
            self.invalidated = True
            raise CaptureViolation("CUDA graph capture: empty_cache while capturing")
        self.flushes += 1

    # ------------------------------------------------- torch.cuda's names, as CudaApi binds them
    def current_device(self) -> int:
        return 0

    @contextlib.contextmanager
    def device(self, d: Any) -> Iterator[None]:
        self.devices.append(d)
        yield

    def graph_pool_handle(self) -> Any:
        handle = ("pool", len(self.pools))
        self.pools.append(handle)
        return handle

    def Stream(self, *args: Any, **kwargs: Any) -> StrictStream:
        s = StrictStream(self, f"side{len(self.streams)}")
        self.streams.append(s)
        return s

    @contextlib.contextmanager
    def stream(self, s: StrictStream) -> Iterator[None]:
        self.events.append(f"enter stream {s.name}")
        self.stream_stack.append(s)
        try:
            yield
        finally:
            self.stream_stack.pop()
            self.events.append(f"exit stream {s.name}")

    def CUDAGraph(self, *args: Any, **kwargs: Any) -> StrictGraph:
        return StrictGraph(self)

    def Event(self, *args: Any, **kwargs: Any) -> StrictEvent:
        return StrictEvent(self, *args, **kwargs)

    def synchronize(self, device: Any = None) -> None:
        self.sync("torch.cuda.synchronize")

    def is_current_stream_capturing(self) -> bool:
        return self.capturing is not None

    @contextlib.contextmanager
    def graph(self, g: StrictGraph, pool: Any = None, stream: Any = None, **kwargs: Any) -> Iterator[None]:
        """``torch.cuda.graph`` as torch 2.11-2.13 enter it: a sync and a cache flush per capture."""
        self.sync("torch.cuda.graph")
        self.empty_cache()
        with self.stream(stream if stream is not None else self.Stream()):
            g.capture_begin(pool)
            try:
                yield
            finally:
                g.capture_end()

    # ------------------------------------------------- the seam
    def factory(self, mode: str, debug: bool, device: torch.device | None,
                agreement: Agreement) -> GraphExecutor:
        """An ``executors.ExecutorFactory``: the graph path of a stage on CPU tensors
        (``graph_mode="emulate"``, or ``"cuda"``) is served by ``CudaGraphExecutor`` on this double."""
        return make_executor("cuda" if mode == "emulate" else mode, debug, device, agreement, cuda=self.api)


@pytest.fixture
def strict_cuda() -> Iterator[StrictCuda]:
    """The double for one test: ``CudaGraphExecutor(cuda=strict_cuda.api)`` runs on it, and so does every
    stage runtime the backend builds meanwhile with ``graph_mode="emulate"`` (its executor factory is
    ``strict_cuda.factory``). Its records (which hold the captured tensors, and through them stage
    runtimes) are dropped after the test, so later tests never see this test's runtimes."""
    api = StrictCuda()
    with executors_made_by(api.factory):
        yield api
    api.graphs.clear()
    api.captured_memory.clear()
    gc.collect()

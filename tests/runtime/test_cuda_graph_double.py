"""``CudaGraphExecutor`` on CPU, with the CUDA graph API replaced by a recording fake.

The fake ``torch.cuda.graph`` context records every aten op run during capture (op, args, kwargs,
outputs) with a ``TorchDispatchMode``; the fake ``CUDAGraph.replay()`` re-runs them in order and copies
each result into the recorded output tensors. That is what a real graph does: it replays fixed kernels on
fixed addresses. So replays are numerically checkable, and a runtime that let a graph read anything but
its captured tensors would give wrong answers here.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import ppcompile
from ppcompile import counters
from ppcompile.backends import pp_breakable as backend
from ppcompile.runtime.executors import CudaGraphExecutor, ReplayAddressError, make_executor, non_owning

H = 8
SIZES = [4, 8, 16]


# ----------------------------------------------------------------------------------------- fake CUDA API
class _Recorder(TorchDispatchMode):
    def __init__(self, graph: FakeGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.graph.ops.append((func, args, kwargs, out))
        return out


class FakeGraph:
    def __init__(self, api: FakeCuda) -> None:
        self.api = api
        self.ops: list[tuple[Any, Any, Any, Any]] = []
        self.replays = 0
        self.pool: Any = None
        self.stream: Any = None
        api.graphs.append(self)

    def replay(self) -> None:
        self.replays += 1
        for func, args, kwargs, out in self.ops:
            res = func(*args, **kwargs)
            for o, r in zip(tree_leaves(out), tree_leaves(res)):
                if isinstance(o, torch.Tensor) and o is not r:
                    o.copy_(r)


class FakeStream:
    def __init__(self, api: FakeCuda, name: str) -> None:
        self.api = api
        self.name = name
        self.waited_on: list[FakeStream] = []

    def wait_stream(self, other: FakeStream) -> None:
        self.api.events.append(f"{self.name}.wait_stream({other.name})")
        self.waited_on.append(other)


@dataclasses.dataclass
class FakeCuda:
    """Records what the executor asks of the CUDA API."""

    events: list[str] = dataclasses.field(default_factory=list)
    graphs: list[FakeGraph] = dataclasses.field(default_factory=list)
    pools: list[Any] = dataclasses.field(default_factory=list)
    streams: list[FakeStream] = dataclasses.field(default_factory=list)
    capturing: bool = False
    stream_stack: list[FakeStream] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.default = FakeStream(self, "default")

    def install(self, mp: pytest.MonkeyPatch) -> None:
        api = self

        def graph_pool_handle() -> Any:
            handle = ("pool", len(api.pools))
            api.pools.append(handle)
            return handle

        def new_stream(*args: Any, **kwargs: Any) -> FakeStream:
            s = FakeStream(api, f"side{len(api.streams)}")
            api.streams.append(s)
            return s

        @contextlib.contextmanager
        def stream(s: FakeStream) -> Iterator[None]:
            api.events.append(f"enter stream {s.name}")
            api.stream_stack.append(s)
            try:
                yield
            finally:
                api.stream_stack.pop()
                api.events.append(f"exit stream {s.name}")

        def current_stream(*args: Any) -> FakeStream:
            return api.stream_stack[-1] if api.stream_stack else api.default

        @contextlib.contextmanager
        def graph(g: FakeGraph, pool: Any = None, stream: Any = None, **kwargs: Any) -> Iterator[None]:
            assert not api.capturing, "nested capture"
            g.pool, g.stream = pool, stream
            api.events.append("begin capture")
            api.capturing = True
            api.stream_stack.append(stream if stream is not None else api.default)
            try:
                with _Recorder(g):
                    yield
            finally:
                api.stream_stack.pop()
                api.capturing = False
                api.events.append("end capture")

        mp.setattr(torch.cuda, "graph_pool_handle", graph_pool_handle)
        mp.setattr(torch.cuda, "Stream", new_stream)
        mp.setattr(torch.cuda, "stream", stream)
        mp.setattr(torch.cuda, "current_stream", current_stream)
        mp.setattr(torch.cuda, "CUDAGraph", lambda *a, **k: FakeGraph(api))
        mp.setattr(torch.cuda, "graph", graph)


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    api = FakeCuda()
    api.install(monkeypatch)
    return api


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    torch._dynamo.reset()
    counters.reset()
    with torch.no_grad():
        yield
    torch._dynamo.reset()


# ----------------------------------------------------------------------------------------- executor alone
W = torch.arange(12.0).view(4, 3) / 10


class _Segment:
    """A toy graph segment that logs, per call, whether a capture was in progress and on which stream."""

    def __init__(self, api: FakeCuda) -> None:
        self.api = api
        self.calls: list[tuple[bool, str]] = []

    def __call__(self, x: torch.Tensor, w: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        stream = self.api.stream_stack[-1].name if self.api.stream_stack else "default"
        self.calls.append((self.api.capturing, stream))
        y = torch.relu(x @ w)
        return y, y.sum(dim=1, keepdim=True) * n


def test_make_executor_cuda_takes_one_pool(cuda: FakeCuda) -> None:
    ex = make_executor("cuda", False)
    assert isinstance(ex, CudaGraphExecutor) and ex.pool == cuda.pools[0] and len(cuda.pools) == 1
    assert ex.num_warmup >= 1


def test_warmup_runs_before_capture_on_a_side_stream(cuda: FakeCuda) -> None:
    ex = CudaGraphExecutor(num_warmup=3)
    seg = _Segment(cuda)
    x = torch.randn(8, 4)
    ex.capture((0, 8), seg, (x, W, 8))
    side = cuda.streams[0].name
    assert seg.calls == [(False, side)] * 3 + [(True, side)]
    assert cuda.events == [
        f"{side}.wait_stream(default)",
        f"enter stream {side}", f"exit stream {side}",
        f"default.wait_stream({side})",
        "begin capture", "end capture",
    ]
    (g,) = cuda.graphs
    assert g.stream is cuda.streams[0]  # captured on the side stream, never on the default stream
    assert g.replays == 0 and g.ops


def test_every_capture_uses_the_same_pool_and_stream(cuda: FakeCuda) -> None:
    ex = CudaGraphExecutor()
    seg = _Segment(cuda)
    x = torch.randn(16, 4)
    for b in (16, 8, 4):
        ex.capture((0, b), seg, (x[:b], W, b))
        ex.capture((2, b), seg, (x[:b], W, b))
    assert len(cuda.graphs) == 6 and len(cuda.pools) == 1 and len(cuda.streams) == 1
    assert all(g.pool is ex.pool for g in cuda.graphs)
    assert all(g.stream is cuda.streams[0] for g in cuda.graphs)
    assert list(ex._captured) == [(0, 16), (2, 16), (0, 8), (2, 8), (0, 4), (2, 4)]
    assert [c.graph for c in ex._captured.values()] == cuda.graphs


def test_replay_runs_the_graph_and_returns_captured_outputs(cuda: FakeCuda) -> None:
    ex = CudaGraphExecutor()
    seg = _Segment(cuda)
    x = torch.randn(8, 4)
    captured = ex.capture((0, 8), seg, (x, W, 8))
    n_calls = len(seg.calls)
    (g,) = cuda.graphs
    for i in range(3):
        x.copy_(torch.randn(8, 4))
        outs = ex.replay((0, 8), (x, W, 8))
        assert g.replays == i + 1
        assert all(a is b for a, b in zip(outs, captured))
        want = seg(x, W, 8)
        torch.testing.assert_close(outs[0], want[0])
        torch.testing.assert_close(outs[1], want[1])
        n_calls += 1  # only the reference call above: replay never calls the segment's Python code
        assert len(seg.calls) == n_calls


def test_strong_references_to_captured_inputs(cuda: FakeCuda) -> None:
    ex = CudaGraphExecutor()
    seg = _Segment(cuda)
    x = torch.randn(8, 4)
    w = W.clone()
    args = (x, w, 8)
    ex.capture((0, 8), seg, args)
    c = ex._captured[(0, 8)]
    assert len(c.args) == 3 and c.args[0] is x and c.args[1] is w and c.args[2] == 8
    assert isinstance(c.args, tuple)  # a copy, not the caller's (mutable) list


def test_debug_replay_rejects_other_inputs(cuda: FakeCuda) -> None:
    ex = CudaGraphExecutor(debug=True)
    seg = _Segment(cuda)
    x = torch.randn(8, 4)
    ex.capture((1, 8), seg, (x, W, 8))
    ex.replay((1, 8), (x, W, 8))
    with pytest.raises(ReplayAddressError, match=r"segment 1 at bucket 8 .*input 0"):
        ex.replay((1, 8), (x.clone(), W, 8))
    assert cuda.graphs[0].replays == 1


def test_a_captured_bucket_holds_its_outputs_through_non_owning_tensors(cuda: FakeCuda) -> None:
    """After ``bucket_captured`` nothing the executor keeps owns a graph output's memory (so the pool
    can hand it to the next bucket), yet replays still show through the same addresses."""
    ex = CudaGraphExecutor()
    seg = _Segment(cuda)
    x = torch.randn(8, 4)
    y, s = ex.capture((0, 8), seg, (x, W, 8))
    ex.capture((1, 8), seg, (y[:, :3].contiguous(), W[:3], 8))  # an unrelated input
    ex.capture((2, 8), lambda t, w, n: (t @ w.T,), (y, W, 8))  # reads segment 0's output
    swap = ex.bucket_captured(8)
    assert set(swap) >= {id(y), id(s)}
    first = ex._captured[(0, 8)]
    assert all(o is not orig and o.data_ptr() == orig.data_ptr() and o.shape == orig.shape
               for o, orig in zip(first.outputs, (y, s)))
    assert ex._captured[(2, 8)].args[0] is swap[id(y)]  # a later graph's read of it is swapped too
    weak_y = first.outputs[0]
    x.copy_(torch.randn(8, 4))
    ex.replay((0, 8), ())
    torch.testing.assert_close(weak_y, torch.relu(x @ W))
    assert ex.bucket_captured(4) == {}  # no graphs of that bucket: nothing to swap


def test_non_owning_tensor_keeps_layout_and_inference_mode() -> None:
    base = torch.arange(24.0).view(4, 6)
    view = base[1:, ::2]
    weak = non_owning(view)
    layout = (view.shape, view.stride(), view.storage_offset())
    assert (weak.shape, weak.stride(), weak.storage_offset()) == layout
    base.add_(1)
    torch.testing.assert_close(weak, view)
    with torch.inference_mode():
        inf = torch.ones(3)
    assert non_owning(inf).is_inference() and not non_owning(base).is_inference()


# ----------------------------------------------------------------------------------------- full runtime
seen_rows: list[int] = []


@torch.library.custom_op("pptest_rt::cg_mixer", mutates_args=())
def cg_mixer(x: torch.Tensor) -> torch.Tensor:
    seen_rows.append(x.shape[0])
    count = torch.arange(1, x.shape[0] + 1, dtype=x.dtype, device=x.device)[:, None]
    return x.cumsum(0) / count + x.mean(0, keepdim=True)


@cg_mixer.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.up = nn.Linear(H, 2 * H)
        self.down = nn.Linear(2 * H, H)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        h = torch.ops.pptest_rt.cg_mixer(h)
        return self.down(h) + x


@pytest.fixture
def cuda_stage(cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> tuple[Stage, Any]:
    monkeypatch.setattr(backend, "_resolve_graph_mode", lambda config, example_inputs: "cuda")
    m = Stage()
    c = torch.compile(m, backend="pp_breakable", dynamic=True, fullgraph=True,
                      options={"capture_sizes": SIZES, "split_ops": ["pptest_rt::cg_mixer"]})
    return m, c


def _runtime() -> Any:
    return [rt for rt in ppcompile.stage_runtimes() if rt.token_symbol is not None][-1]


def test_runtime_captures_largest_bucket_first_in_one_pool(cuda: FakeCuda, cuda_stage: Any) -> None:
    m, c = cuda_stage
    x = torch.randn(5, H)
    torch.testing.assert_close(c(x), m(x))
    rt = _runtime()
    assert rt.graph_mode == "cuda"
    (state,) = rt.instances()
    ex = state.executor
    assert isinstance(ex, CudaGraphExecutor)
    steps = [st.index for st in rt.program.steps if st.segment.is_graph]
    assert list(ex._captured) == [(s, b) for b in (16, 8, 4) for s in steps]
    assert [c.graph for c in ex._captured.values()] == cuda.graphs
    assert len(cuda.pools) == 1 and all(g.pool is ex.pool for g in cuda.graphs)
    assert counters.captures == len(steps) * 3
    # strong references: every tensor a graph reads is held by the executor
    for key, cap in ex._captured.items():
        assert all(a is not None for a in cap.args), key


def test_runtime_replays_graphs_and_matches_eager(cuda: FakeCuda, cuda_stage: Any) -> None:
    m, c = cuda_stage
    for i, n in enumerate([5, 4, 8, 9, 16, 17, 3, 12, 6, 2]):
        torch.manual_seed(i)
        x = torch.randn(n, H)
        seen_rows.clear()
        before = {id(g): g.replays for g in cuda.graphs}
        got = c(x)
        assert seen_rows == [n]  # the break op ran eagerly on the live rows
        torch.testing.assert_close(got, m(x))
        rt = _runtime()
        (state,) = rt.instances()
        ex = state.executor
        replayed = {k for k, cap in ex._captured.items() if cap.graph.replays > before.get(id(cap.graph), 0)}
        b = rt.plan.bucket(n)
        if b is None:
            assert not replayed
            continue
        assert replayed == {k for k in ex._captured if k[1] == b}
        assert all(cap.graph.replays - before.get(id(cap.graph), 0) == 1
                   for k, cap in ex._captured.items() if k in replayed)
        # the stage output is a view into the last graph segment's captured output
        last = ex._captured[(max(s for s, _ in ex._captured), b)].outputs[0]
        assert got.untyped_storage().data_ptr() == last.untyped_storage().data_ptr()
    assert counters.replays == 9 and counters.eager_runs == 1
    assert len(cuda.graphs) == 6  # captured once


def test_capture_session_keeps_the_collector_off(cuda: FakeCuda) -> None:
    import gc

    ex = CudaGraphExecutor()
    assert gc.isenabled()
    with ex.capture_session():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), ex.capture_session():
        raise RuntimeError("capture failed")
    assert gc.isenabled()

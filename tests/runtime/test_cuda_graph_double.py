"""``CudaGraphExecutor`` and the CUDA path of the runtime on CPU, under the strict capture double.

``tests/cuda_double.py`` is the executor's CUDA API (``cuda=strict_cuda.api``; the executor factory of
the stages compiled here with ``graph_mode="emulate"``): a capture records aten ops without running them
(its outputs hold garbage until a replay), raises on what real capture rejects, and a replay runs the
record on the captured tensors. So replays are numerically checkable, and a runtime that reads a
capture's outputs before a replay, or lets a graph read anything but its captured tensors, fails here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from cuda_double import CaptureViolation, StrictCuda
from runtime_helpers import symbolic_runtime
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from ppcompile import counters
from ppcompile.runtime.executors import (
    CudaGraphExecutor,
    ReplayAddressError,
    _Captured,
    make_executor,
    non_owning,
)
from ppcompile.runtime.group_agreement import Agreement, GroupCaptureError

H = 8
SIZES = [4, 8, 16]


@pytest.fixture
def cuda(strict_cuda: StrictCuda) -> StrictCuda:
    return strict_cuda


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

    def __init__(self, api: StrictCuda) -> None:
        self.api = api
        self.calls: list[tuple[bool, str]] = []

    def __call__(self, x: torch.Tensor, w: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        stream = self.api.stream_stack[-1].name if self.api.stream_stack else "default"
        self.calls.append((self.api.capturing is not None, stream))
        y = torch.relu(x @ w)
        return y, y.sum(dim=1, keepdim=True) * n


def test_make_executor_cuda_takes_one_pool(cuda: StrictCuda) -> None:
    ex = make_executor("cuda", False, cuda=cuda.api)
    assert isinstance(ex, CudaGraphExecutor) and ex.pool == cuda.pools[0] and len(cuda.pools) == 1
    assert ex.num_warmup >= 1


def test_warmup_then_capture_then_one_replay_on_a_side_stream(cuda: StrictCuda) -> None:
    ex = CudaGraphExecutor(num_warmup=3, cuda=cuda.api)
    seg = _Segment(cuda)
    x = torch.randn(8, 4)
    y, _ = ex.capture((0, 8), seg, (x, W, 8))
    side = cuda.streams[0].name
    assert seg.calls == [(False, side)] * 3 + [(True, side)]
    assert cuda.events == [
        f"{side}.wait_stream(default)",
        f"enter stream {side}", f"exit stream {side}",  # warm-ups
        f"enter stream {side}", "begin capture", "end capture", f"exit stream {side}",
        f"enter stream {side}", f"exit stream {side}",  # the replay that gives the outputs values
        f"default.wait_stream({side})",
    ]
    (g,) = cuda.graphs
    assert g.stream is cuda.streams[0]  # captured on the side stream, never on the default stream
    assert g.replays == 1 and g.ops
    torch.testing.assert_close(y, torch.relu(x @ W))  # not the garbage the capture left
    assert cuda.flushes == 0 and cuda.syncs == 0  # a capture alone neither flushes nor syncs


def test_a_capture_alone_leaves_garbage_in_its_outputs(cuda: StrictCuda) -> None:
    """The double's capture runs nothing: what the executor's replay after capture is for."""
    g = cuda.CUDAGraph()
    x = torch.arange(6.0).view(2, 3)
    with cuda.stream(cuda.Stream()):
        g.capture_begin()
        y = x * 2
        i = x.long() + 1
        g.capture_end()
    assert torch.isnan(y).all() and (i > 10**6).all()
    g.replay()
    torch.testing.assert_close(y, x * 2)
    assert i.tolist() == [[1, 2, 3], [4, 5, 6]]


def test_every_capture_uses_the_same_pool_and_stream(cuda: StrictCuda) -> None:
    ex = CudaGraphExecutor(cuda=cuda.api)
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


def test_replay_runs_the_graph_and_returns_captured_outputs(cuda: StrictCuda) -> None:
    ex = CudaGraphExecutor(cuda=cuda.api)
    seg = _Segment(cuda)
    x = torch.randn(8, 4)
    captured = ex.capture((0, 8), seg, (x, W, 8))
    n_calls = len(seg.calls)
    (g,) = cuda.graphs
    for i in range(3):
        x.copy_(torch.randn(8, 4))
        outs = ex.replay((0, 8), (x, W, 8))
        assert g.replays == i + 2  # the capture's own replay, then these
        assert all(a is b for a, b in zip(outs, captured))
        want = seg(x, W, 8)
        torch.testing.assert_close(outs[0], want[0])
        torch.testing.assert_close(outs[1], want[1])
        n_calls += 1  # only the reference call above: replay never calls the segment's Python code
        assert len(seg.calls) == n_calls


def test_strong_references_to_captured_inputs(cuda: StrictCuda) -> None:
    ex = CudaGraphExecutor(cuda=cuda.api)
    seg = _Segment(cuda)
    x = torch.randn(8, 4)
    w = W.clone()
    args = (x, w, 8)
    ex.capture((0, 8), seg, args)
    c = ex._captured[(0, 8)]
    assert len(c.args) == 3 and c.args[0] is x and c.args[1] is w and c.args[2] == 8
    assert isinstance(c.args, tuple)  # a copy, not the caller's (mutable) list


def test_debug_replay_rejects_other_inputs(cuda: StrictCuda) -> None:
    ex = CudaGraphExecutor(debug=True, cuda=cuda.api)
    seg = _Segment(cuda)
    x = torch.randn(8, 4)
    ex.capture((1, 8), seg, (x, W, 8))
    ex.replay((1, 8), (x, W, 8))
    with pytest.raises(ReplayAddressError, match=r"segment 1 at bucket 8 .*input 0"):
        ex.replay((1, 8), (x.clone(), W, 8))
    assert cuda.graphs[0].replays == 2  # the capture's own and the first: the rejected one never ran


def test_a_captured_bucket_holds_its_outputs_through_non_owning_tensors(cuda: StrictCuda) -> None:
    """After ``bucket_captured`` nothing the executor keeps owns a graph output's memory (so the pool
    can hand it to the next bucket), yet replays still show through the same addresses."""
    ex = CudaGraphExecutor(cuda=cuda.api)
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
def cuda_stage(cuda: StrictCuda) -> tuple[Stage, Any]:
    m = Stage()
    c = torch.compile(m, backend="pp_breakable", dynamic=True, fullgraph=True,
                      options={"capture_sizes": SIZES, "split_ops": ["pptest_rt::cg_mixer"],
                               "graph_mode": "emulate"})  # the graph path on CPU: CUDA graphs on the double
    return m, c


def test_runtime_captures_largest_bucket_first_in_one_pool(cuda: StrictCuda, cuda_stage: Any) -> None:
    m, c = cuda_stage
    x = torch.randn(5, H)
    torch.testing.assert_close(c(x), m(x))
    rt = symbolic_runtime(m)
    assert rt.graph_mode == "emulate"  # served by the double's factory (strict_cuda.factory)
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


def test_runtime_replays_graphs_and_matches_eager(cuda: StrictCuda, cuda_stage: Any) -> None:
    m, c = cuda_stage
    for i, n in enumerate([5, 4, 8, 9, 16, 17, 3, 12, 6, 2]):
        torch.manual_seed(i)
        x = torch.randn(n, H)
        seen_rows.clear()
        before = {id(g): g.replays for g in cuda.graphs}
        got = c(x)
        assert seen_rows == [n]  # the break op ran eagerly on the live rows
        torch.testing.assert_close(got, m(x))
        rt = symbolic_runtime(m)
        (state,) = rt.instances()
        ex = state.executor
        replayed = {k for k, cap in ex._captured.items() if cap.graph.replays > before.get(id(cap.graph), 1)}
        b = rt.plan.bucket(n)
        if b is None:
            assert not replayed
            continue
        assert replayed == {k for k in ex._captured if k[1] == b}
        assert all(cap.graph.replays - before.get(id(cap.graph), 1) == 1
                   for k, cap in ex._captured.items() if k in replayed)
        # the stage output is the caller's copy (owned outputs, the default) of the last graph
        # segment's captured output
        last = ex._captured[(max(s for s, _ in ex._captured), b)].outputs[0]
        assert got.untyped_storage().data_ptr() != last.untyped_storage().data_ptr()
        assert torch.equal(got, last[:n])
    assert counters.replays == 9 and counters.eager_runs == 1
    assert len(cuda.graphs) == 6  # captured once


def test_capture_session_keeps_the_collector_off(cuda: StrictCuda) -> None:
    import gc

    ex = CudaGraphExecutor(cuda=cuda.api)
    assert gc.isenabled()
    with ex.capture_session():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), ex.capture_session():
        raise RuntimeError("capture failed")
    assert gc.isenabled()


# ----------------------------------------------------------------------------------------- capture rules
def _ids(x: torch.Tensor, n: int) -> tuple[torch.Tensor]:
    """Segment 0: an integer id per token."""
    return ((x.abs() * 3).long().clamp(max=3)[:, 0],)


TABLE = torch.arange(8.0).view(4, 2)


def _lookup(ids: torch.Tensor, table: torch.Tensor, n: int) -> tuple[torch.Tensor]:
    """Segment 1: an embedding lookup by segment 0's ids."""
    return (torch.nn.functional.embedding(ids, table),)


class _NoReplayAfterCapture(CudaGraphExecutor):
    """The executor as it was: warm-ups, then capture (``torch.cuda.graph``), nothing run in between."""

    def __init__(self, double: StrictCuda) -> None:
        super().__init__(cuda=double.api)
        self.double = double

    def capture(self, key: Any, fn: Any, args: Any, shapes: Any = None, strides: Any = None) -> Any:
        stream = self._stream
        stream.wait_stream(self.cuda.current_stream())
        with self.cuda.stream(stream):
            for _ in range(self.num_warmup):
                fn(*args)
        graph = self.cuda.CUDAGraph()
        with self.double.graph(graph, pool=self.pool, stream=stream):
            outputs = tuple(fn(*args))
        self._captured[key] = _Captured(fn, tuple(args), outputs, graph)
        return outputs


def test_warm_ups_never_read_a_capture_that_did_not_run(cuda: StrictCuda) -> None:
    """Segment 1's warm-ups read segment 0's outputs: without a replay after capture they hold garbage,
    and an index read from it is out of bounds (on a GPU a device assert that kills the process)."""
    x = torch.randn(8, 4)
    old = _NoReplayAfterCapture(cuda)
    (ids,) = old.capture((0, 8), _ids, (x, 8))
    with pytest.raises(IndexError):
        old.capture((1, 8), _lookup, (ids, TABLE, 8))
    ex = CudaGraphExecutor(cuda=cuda.api)
    (ids,) = ex.capture((0, 8), _ids, (x, 8))
    (rows,) = ex.capture((1, 8), _lookup, (ids, TABLE, 8))
    torch.testing.assert_close(rows, TABLE[_ids(x, 8)[0]])
    x.copy_(torch.randn(8, 4))
    ex.replay((0, 8), ())
    ex.replay((1, 8), ())
    torch.testing.assert_close(rows, TABLE[_ids(x, 8)[0]])


def test_torch_cuda_graph_flushes_per_capture_and_the_executor_does_not(cuda: StrictCuda) -> None:
    old = _NoReplayAfterCapture(cuda)
    for b in (8, 4):
        old.capture((0, b), _ids, (torch.randn(b, 4), b))
    assert cuda.flushes == 2 and cuda.syncs == 2  # torch.cuda.graph: one flush and one sync per capture
    ex = CudaGraphExecutor(cuda=cuda.api)
    with ex.capture_session():
        for b in (16, 8, 4, 2):
            ex.capture((0, b), _ids, (torch.randn(b, 4), b))
    assert cuda.flushes == 3 and cuda.syncs == 3  # one of each for the whole session


def test_an_op_that_breaks_capture_is_the_error_not_capture_end(cuda: StrictCuda) -> None:
    ex = CudaGraphExecutor(cuda=cuda.api)
    with pytest.raises(CaptureViolation, match="_local_scalar_dense") as info:
        ex.capture((0, 8), lambda x: (x * x.sum().item(),), (torch.randn(8, 4),))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "ending the broken capture then failed too" in notes and "not permitted" in notes
    assert cuda.capturing is None  # the capture was ended: the next one can begin
    ex.capture((0, 4), lambda x: (x * 2,), (torch.randn(4, 4),))


@pytest.mark.parametrize(("fn", "what"), [  # fn(the CUDA API, x): a segment
    (lambda c, x: (x.nonzero(),), "nonzero"),
    (lambda c, x: (torch.masked_select(x, x > 0),), "masked_select"),
    (lambda c, x: (torch.unique(x),), "_unique2"),
    (lambda c, x: (x.long().flatten().abs().bincount(),), "bincount"),
    (lambda c, x: (torch.repeat_interleave(x, (x[:, 0] > 0).long(), dim=0),), "repeat_interleave"),
    (lambda c, x: (x + torch.rand(x.shape, generator=torch.Generator().manual_seed(0)),), "generator"),
    (lambda c, x: (x * bool(x[0, 0] > 0),), "_local_scalar_dense"),
    (lambda c, x: (x.tolist(), x)[1:], "Tensor.tolist"),
    (lambda c, x: (x.numpy(), x)[1:], "Tensor.numpy"),
    (lambda c, x: (c.synchronize(), x)[1:], "synchronize"),
    (lambda c, x: (c.Event().query(), x)[1:], "Event.query"),
    (lambda c, x: (c.empty_cache(), x)[1:], "empty_cache"),
])
def test_what_real_capture_rejects_raises_naming_it(cuda: StrictCuda, fn: Any, what: str) -> None:
    with pytest.raises(CaptureViolation, match=what):
        CudaGraphExecutor(num_warmup=0, cuda=cuda.api).capture((0, 8), lambda x: fn(cuda, x),
                                                               (torch.randn(8, 4),))


def test_what_capture_accepts_passes(cuda: StrictCuda) -> None:
    """The twins of the rejected ops: static sizes and the default generator."""
    x = torch.randn(8, 4)
    ex = CudaGraphExecutor(num_warmup=0, cuda=cuda.api)
    ex.capture((0, 8), lambda x: (torch.repeat_interleave(x, 2, dim=0),), (x,))
    ex.capture((1, 8), lambda x: (torch.repeat_interleave(x, torch.full((8,), 2), dim=0, output_size=16),),
               (x,))
    ex.capture((2, 8), lambda x: (x + torch.rand(x.shape),), (x,))
    ex.capture((3, 8), lambda x: (torch.nonzero_static(x > 0, size=32),), (x,))


def test_allocating_off_the_capture_stream_raises(cuda: StrictCuda) -> None:
    other = cuda.Stream()

    def off_stream(x: torch.Tensor) -> tuple[torch.Tensor]:
        with cuda.stream(other):
            return (x * 2,)

    with pytest.raises(CaptureViolation, match="runs on stream side0 while stream side1 captures"):
        CudaGraphExecutor(num_warmup=0, cuda=cuda.api).capture((0, 8), off_stream, (torch.randn(8, 4),))


def test_the_executor_works_on_the_stages_device(cuda: StrictCuda) -> None:
    ex = make_executor("cuda", False, torch.device("cuda", 1), cuda=cuda.api)
    assert isinstance(ex, CudaGraphExecutor) and ex.device == torch.device("cuda", 1)
    ex.capture((0, 8), _ids, (torch.randn(8, 4), 8))
    with ex.capture_session():
        pass
    assert cuda.devices and all(d == torch.device("cuda", 1) for d in cuda.devices)


# ----------------------------------------------------------------------------------------- capture failures
@torch.library.custom_op("pptest_rt::host_scaled", mutates_args=())
def host_scaled(x: torch.Tensor) -> torch.Tensor:
    """Token-local, but it reads a value on the host: fine eagerly, a sync under capture. Hidden from
    the compile-time probe (which runs it on fake tensors), as a C++ kernel's host read would be."""
    if is_fake(x):
        return torch.empty_like(x)
    return x * float(x.abs().max().item() > 0)


@host_scaled.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class HostReadStage(Stage):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.ops.pptest_rt.host_scaled(torch.relu(self.up(x)))
        h = torch.ops.pptest_rt.cg_mixer(h)
        return self.down(h) + x


def test_a_failed_capture_names_the_op_and_the_node_then_serves_eagerly(cuda: StrictCuda) -> None:
    m = HostReadStage()
    c = torch.compile(m, backend="pp_breakable", dynamic=True, fullgraph=True,
                      options={"capture_sizes": SIZES, "split_ops": ["pptest_rt::cg_mixer"],
                               "token_local_ops": ["pptest_rt::host_scaled"], "graph_mode": "emulate"})
    x = torch.randn(5, H)
    with pytest.raises(RuntimeError) as info:
        c(x)
    message = str(info.value)
    assert "capturing segment" in message and "for bucket 16" in message
    assert "aten.item" in message and "reads a device value" in message  # the op's error, not capture_end's
    assert "at node host_scaled" in message and "test_cuda_graph_double.py" in message
    torch.testing.assert_close(c(x), m(x))  # graphs are off for the instance: eager from now on
    assert counters.eager_runs == 1


class _OtherRankFails(Agreement):
    """A TP group of two whose other rank's capture fails; records when the capture is settled."""

    size = 2

    def __init__(self, cuda: StrictCuda) -> None:
        super().__init__()
        self.cuda = cuda

    def exchange(self, values: Sequence[int]) -> list[tuple[int, ...]]:
        self.cuda.events.append("settle")
        return [tuple(values), (0,) * len(values)]


def test_a_capture_is_settled_with_the_group_before_its_replay(cuda: StrictCuda) -> None:
    """The replay after capture runs the segment's collectives: a rank whose peer failed to capture must
    not launch them, so the failure is learnt before the replay and nothing is replayed."""
    ex = CudaGraphExecutor(num_warmup=2, agreement=_OtherRankFails(cuda), cuda=cuda.api)
    with pytest.raises(GroupCaptureError, match=r"rank\(s\) \[1\]") as info:
        ex.capture((0, 8), _Segment(cuda), (torch.randn(8, 4), W, 8))
    assert info.value.ranks == [1]
    assert cuda.events.index("settle") > cuda.events.index("end capture")
    assert cuda.events[cuda.events.index("settle"):] == ["settle"]  # no replay, no stream work after it
    (g,) = cuda.graphs
    assert g.replays == 0

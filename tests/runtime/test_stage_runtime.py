"""Tests for ``ppcompile.runtime.stage_runtime`` through the ``pp_breakable`` backend, on small stages.

The stage under test is two graph segments around a user break op (``pptest_rt::mixer``), whose result
depends on every live row (a causal mean plus the mean over all rows), so a break that saw padding rows,
or a graph that read a stale buffer, gives a visibly different answer. Graphs run in the emulated
executor (CPU), which gives CUDA-graph semantics: graphs read only the tensors they captured.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from mixer_stage import MixerStage, register_mixer
from torch import nn

import ppcompile
from ppcompile import counters
from ppcompile.debug import build_report, publish_report
from ppcompile.models import REFERENCE_CONFIGS, make_forward_context, set_forward_context
from ppcompile.runtime.executors import EagerExecutor, EmulatedGraphExecutor, ReplayAddressError
from ppcompile.runtime.stage_runtime import StageRuntime

H = 8
SIZES = [4, 8, 16]
seen_rows: list[int] = []


mixer = register_mixer("pptest_rt::mixer", lambda x: seen_rows.append(x.shape[0]))


def _mixer_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    pass


def _mixer_backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    n = grad.shape[0]
    count = torch.arange(1, n + 1, dtype=grad.dtype, device=grad.device)[:, None]
    return (grad / count).flip(0).cumsum(0).flip(0) + grad.sum(0, keepdim=True) / n


mixer.register_autograd(_mixer_backward, setup_context=_mixer_setup)


class Stage(MixerStage):
    """graph (up) | break (mixer) | graph (down); two live inputs, two outputs."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(torch.ops.pptest_rt.mixer, H, seed)


class HalfStage(nn.Module):
    """Returns an output whose token dim is ``s0 // 2``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h.view(h.shape[0] // 2, -1)


def _compile(m: nn.Module, **options: Any) -> Any:
    """``m`` under ``pp_breakable``; the graph path's emulation unless ``options`` name another graph mode
    (these tests check graph semantics, which ``"auto"`` does not take on CPU)."""
    opts = {"capture_sizes": SIZES, "split_ops": ["pptest_rt::mixer"], "graph_mode": "emulate", **options}
    return torch.compile(m, backend="pp_breakable", dynamic=True, fullgraph=True, options=opts)


def _inputs(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(n, H, generator=g), torch.randn(n, H, generator=g)


def _check(compiled: Any, m: nn.Module, n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    args = _inputs(n, seed)
    got = compiled(*args)
    want = m(*args)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w)
    return got


def _runtime() -> StageRuntime:
    """The newest runtime with a dynamic token dim (Dynamo specializes 1 token to a static graph)."""
    return [rt for rt in ppcompile.stage_runtimes() if rt.token_symbol is not None][-1]


def _state(rt: StageRuntime) -> Any:
    (state,) = rt.instances()
    return state


def _graph_steps(rt: StageRuntime) -> list[int]:
    return [st.index for st in rt.program.steps if st.segment.is_graph]


@pytest.fixture(autouse=True)
def _fresh(fresh_dynamo: None) -> Iterator[None]:
    """Fresh Dynamo and counters (tests/conftest.py), no rows seen yet, no autograd."""
    seen_rows.clear()
    with torch.no_grad():
        yield


# ----------------------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("mode", ["emulate", "eager"])
def test_graph_modes_match_eager_across_token_counts(mode: str) -> None:
    m = Stage()
    c = _compile(m, graph_mode=mode)
    for i, n in enumerate([5, 1, 4, 8, 9, 16, 17, 40, 2, 3, 12, 5]):
        _check(c, m, n, seed=i)
    rt = _runtime()
    assert rt.graph_mode == mode
    assert rt.eager_reason is None
    executor = _state(rt).executor
    assert isinstance(executor, EagerExecutor if mode == "eager" else EmulatedGraphExecutor)
    assert counters.replays == 9 and counters.replays_by_bucket == {4: 3, 8: 3, 16: 3}


@pytest.mark.parametrize("mode", ["none", "auto"])  # auto on CPU: the live path, faster than the emulation
def test_graph_mode_none_runs_segments_at_live_size_without_buffers(mode: str) -> None:
    m = Stage()
    c = _compile(m, graph_mode=mode)
    counts = [5, 1, 4, 8, 9, 16, 17, 40]  # inside, at and one past buckets, above the cap
    with counters.expect(replays=0, captures=0, eager_runs=len(counts), replays_by_bucket={}):
        for i, n in enumerate(counts):
            _check(c, m, n, seed=i)
    rt = _runtime()
    assert rt.graph_mode == "none" and "graph_mode='none'" in (rt.eager_reason or "")
    assert (f"graph_mode='{mode}'" in (rt.eager_reason or "")) and rt.config.graph_mode == mode
    assert rt.instances() == ()  # no static buffers, no executor: nothing was allocated for graphs
    assert seen_rows[-1] == 40  # break ops see the live rows, nothing padded


def test_structure_and_describe() -> None:
    m = Stage()
    c = _compile(m)
    _check(c, m, 5)
    rt = _runtime()
    assert [s.is_graph for s in rt.segments] == [True, False, True]
    assert rt.plan.sizes == (4, 8, 16)
    text = rt.describe()
    assert "3 segments" in text and "graph mode emulate" in text and "pptest_rt" in text
    assert len(rt.program.input_buffers) == 2 and len(rt.program.bridge_buffers) == 1


def test_debug_mode_matches_eager() -> None:
    m = Stage()
    c = _compile(m, debug=True)
    for i, n in enumerate([5, 4, 8, 9, 16, 3]):
        _check(c, m, n, seed=i)
    assert counters.replays == 6


# ----------------------------------------------------------------------------------------- counters
def test_counters_per_call() -> None:
    m = Stage()
    c = _compile(m)
    n_graph = len(SIZES) * 2  # 2 graph segments x 3 buckets, all captured at the first graph call
    with counters.expect(replays=1, eager_runs=0, captures=n_graph, backend_compiles=1,
                         replays_by_bucket={8: 1}):
        _check(c, m, 5)
    assert _graph_steps(_runtime()) == [0, 2]
    with counters.expect(replays=1, eager_runs=0, captures=0, replays_by_bucket={8: 1}):
        _check(c, m, 8)
    with counters.expect(replays=1, eager_runs=0, captures=0, replays_by_bucket={16: 1}):
        _check(c, m, 9)
    with counters.expect(replays=1, eager_runs=0, captures=0, replays_by_bucket={16: 1}):
        _check(c, m, 16)
    with counters.expect(replays=0, eager_runs=1, captures=0, replays_by_bucket={}):
        _check(c, m, 17)  # above the cap
    with counters.expect(replays=1, eager_runs=0, captures=0, replays_by_bucket={4: 1}):
        _check(c, m, 2)
    with counters.expect(replays=1, eager_runs=0, captures=0, backend_compiles=0, replays_by_bucket={4: 1}):
        _check(c, m, 4)


def test_padding_guard_runs_eagerly() -> None:
    m = Stage()
    c = _compile(m, capture_sizes=[16], max_padding_factor=2.0)
    with counters.expect(replays=1, eager_runs=0, replays_by_bucket={16: 1}):
        _check(c, m, 9)
    with counters.expect(replays=0, eager_runs=1, captures=0):
        _check(c, m, 7)  # 16 > 2 * 7
    assert _runtime().plan.eager_reason(7) is not None


def test_captures_largest_bucket_first(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[tuple[int, int]] = []
    real = EmulatedGraphExecutor.capture

    def recording(
        self: EmulatedGraphExecutor, key: tuple[int, int], fn: Any, args: Any, shapes: Any = None,
        strides: Any = None,
    ) -> Any:
        order.append(key)
        return real(self, key, fn, args, shapes, strides)

    monkeypatch.setattr(EmulatedGraphExecutor, "capture", recording)
    m = Stage()
    c = _compile(m)
    _check(c, m, 3)
    steps = _graph_steps(_runtime())
    want = [(s, b) for b in sorted(SIZES, reverse=True) for s in steps]
    assert order == want
    assert list(_state(_runtime()).executor._captured) == want
    _check(c, m, 6)
    assert len(order) == len(want)  # no recapture


# ----------------------------------------------------------------------------------------- invariants
def test_break_op_sees_live_rows_only() -> None:
    m = Stage()
    c = _compile(m)
    for n in [5, 3, 8, 9, 13, 16, 17, 2]:
        seen_rows.clear()
        c(*_inputs(n))
        assert seen_rows == [n], f"break op saw {seen_rows} rows for {n} live tokens"


def test_padding_rows_of_static_buffers_are_zero() -> None:
    m = Stage()
    c = _compile(m)
    _check(c, m, 16)
    _check(c, m, 8)
    state = _state(_runtime())
    bufs = [*state.input_buffers.values(), *state.bridge_buffers.values()]
    assert len(bufs) == 3 and all(b.shape[0] == 16 for b in bufs)
    assert all(b[:8].abs().sum() > 0 for b in bufs)
    _check(c, m, 5)  # bucket 8: rows [5:8] must be zeroed again
    for b in bufs:
        assert b[:5].abs().sum() > 0
        assert not b[5:8].any()
    _check(c, m, 3)  # bucket 4
    for b in bufs:
        assert not b[3:4].any()


def test_inputs_not_modified_and_outputs_have_live_shapes() -> None:
    m = Stage()
    c = _compile(m)
    for n in [5, 8, 11]:
        x, r = _inputs(n)
        x0, r0 = x.clone(), r.clone()
        out, out2 = c(x, r)
        assert out.shape == (n, H) and out2.shape == (n, H)
        assert torch.equal(x, x0) and torch.equal(r, r0)


def test_two_instances_share_one_compile_but_not_graphs() -> None:
    m1, m2 = Stage(seed=1), Stage(seed=2)
    c1, c2 = _compile(m1), _compile(m2)
    for i, n in enumerate([5, 6, 8, 3, 12, 7]):
        _check(c1, m1, n, seed=i)
        _check(c2, m2, n, seed=i)
    assert counters.backend_compiles == 1
    rt = _runtime()
    assert len(rt.instances()) == 2
    ids = [{id(t) for t in s.module_state} for s in rt.instances()]
    assert ids[0] == {id(p) for p in m1.parameters()} or ids[1] == {id(p) for p in m1.parameters()}
    assert ids[0].isdisjoint(ids[1])
    assert counters.captures == 2 * len(SIZES) * 2


def test_inference_mode_calls_use_graphs_and_match() -> None:
    m = Stage()
    c = _compile(m)
    with torch.inference_mode():
        for i, n in enumerate([5, 16, 3, 9, 17]):
            _check(c, m, n, seed=i)
    assert counters.replays == 4 and counters.eager_runs == 1
    runtime = _runtime()
    (state,) = runtime.instances()
    # Buffers follow the caller's mode, so graph outputs are inference tensors like eager's.
    assert all(b.is_inference() for b in (*state.input_buffers.values(), *state.bridge_buffers.values()))
    with torch.no_grad():  # outside inference mode: plain buffers (Dynamo may also recompile)
        _check(c, m, 9, seed=7)
    states = [s for rt in ppcompile.stage_runtimes() for s in rt.instances() if s is not state]
    assert len(states) == 1 and not any(b.is_inference() for b in states[0].input_buffers.values())


class TransposedStage(nn.Module):
    """An output whose token dim is not the leading one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.ops.pptest_rt.mixer(torch.relu(self.lin(x)))
        y = self.lin(h)
        return y.t(), y.t() * 2


def test_output_with_token_dim_last_is_trimmed() -> None:
    m = TransposedStage()
    c = _compile(m)
    for n in [5, 8, 3, 13]:
        x = torch.randn(n, H)
        got = c(x)
        for g, w in zip(got, m(x)):
            assert g.shape == (H, n)
            torch.testing.assert_close(g, w)
    assert counters.replays == 4


def test_graph_mode_cuda_on_cpu_raises_at_compile() -> None:
    m = Stage()
    c = _compile(m, graph_mode="cuda")
    with pytest.raises(Exception, match="graph_mode") as info:
        c(*_inputs(5))
    chain = [info.value, getattr(info.value, "inner_exception", None), info.value.__cause__]
    assert any(isinstance(e, ValueError) for e in chain), chain
    assert "not on a CUDA device" in str(info.value)


def test_autograd_enabled_runs_eagerly_and_matches() -> None:
    m = Stage()
    c = _compile(m)
    with torch.enable_grad():
        x, r = _inputs(5)
        x.requires_grad_(True)
        with counters.expect(replays=0, eager_runs=1, captures=0):
            out, out2 = c(x, r)
        want, want2 = m(x, r)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(out2, want2)
        (gx,) = torch.autograd.grad(out.sum() + out2.sum(), x)
        (wx,) = torch.autograd.grad(want.sum() + want2.sum(), x)
        torch.testing.assert_close(gx, wx)
        with counters.expect(replays=0, eager_runs=1, captures=0):
            _check(c, m, 8)


def test_capture_failure_names_segment_and_bucket_then_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    real = EmulatedGraphExecutor.capture
    calls = {"n": 0}

    def fail_once(

        self: EmulatedGraphExecutor, key: tuple[int, int], fn: Any, args: Any, shapes: Any = None,
        strides: Any = None,

    ) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise MemoryError("out of graph memory (test)")
        return real(self, key, fn, args, shapes, strides)

    monkeypatch.setattr(EmulatedGraphExecutor, "capture", fail_once)
    m = Stage()
    c = _compile(m)
    with pytest.raises(RuntimeError, match=r"segment submod_0 .* bucket 16 .*MemoryError"):
        c(*_inputs(5))
    for i, n in enumerate([5, 8, 3, 17]):
        with counters.expect(replays=0, eager_runs=1, captures=0):
            _check(c, m, n, seed=i)
    assert calls["n"] == 1  # no capture retried on every call
    state = _state(_runtime())
    assert state.failed is not None and "MemoryError" in state.failed
    assert not state.tables


def test_failed_capture_releases_graphs_captured_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real = EmulatedGraphExecutor.capture

    def fail_at_bucket_4(

        self: EmulatedGraphExecutor, key: tuple[int, int], fn: Any, args: Any, shapes: Any = None,
        strides: Any = None,

    ) -> Any:
        if key[1] == 4:
            raise RuntimeError("no memory left for bucket 4 (test)")
        return real(self, key, fn, args, shapes, strides)

    monkeypatch.setattr(EmulatedGraphExecutor, "capture", fail_at_bucket_4)
    m = Stage()
    c = _compile(m)
    with pytest.raises(RuntimeError, match=r"segment submod_0 .* bucket 4"):
        c(*_inputs(9))
    assert counters.captures == 4  # buckets 16 and 8 were captured before the failure
    state = _state(_runtime())
    assert state.executor.num_captured() == 0  # ... and released: graphs are off for this state
    _check(c, m, 9)


def test_persistent_capture_failure_leaves_runtime_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    def always_fail(
        self: EmulatedGraphExecutor, key: tuple[int, int], fn: Any, args: Any, shapes: Any = None,
        strides: Any = None,
    ) -> Any:
        raise RuntimeError("capture not possible (test)")

    monkeypatch.setattr(EmulatedGraphExecutor, "capture", always_fail)
    m = Stage()
    c = _compile(m)
    with pytest.raises(RuntimeError, match="bucket 16"):
        c(*_inputs(5))
    for i, n in enumerate([5, 9, 2]):
        _check(c, m, n, seed=i)


def test_owned_outputs_do_not_share_storage_with_static_buffers() -> None:
    m = Stage()
    c = _compile(m, owned_outputs=True)
    outs = [_check(c, m, n, seed=i) for i, n in enumerate([5, 8, 12])]
    state = _state(_runtime())
    static: list[torch.Tensor] = [*state.input_buffers.values(), *state.bridge_buffers.values()]
    for cap in state.executor._captured.values():
        static += [t for t in (*cap.args, *cap.outputs) if isinstance(t, torch.Tensor)]
    static_ptrs = {t.untyped_storage().data_ptr() for t in static}
    for group in outs:
        for t in group:
            assert t.untyped_storage().data_ptr() not in static_ptrs


def test_output_with_half_token_dim_is_trimmed() -> None:
    m = HalfStage()
    c = torch.compile(m, backend="pp_breakable", dynamic=True, fullgraph=True,
                      options={"capture_sizes": SIZES, "graph_mode": "emulate"})
    for n in [6, 2, 4, 8, 10, 16, 20]:
        x = torch.randn(n, H)
        got = c(x)
        assert got.shape == (n // 2, 2 * H)
        torch.testing.assert_close(got, m(x))
    assert counters.replays == 6 and counters.eager_runs == 1
    assert counters.replays_by_bucket == {8: 2, 4: 2, 16: 2}


class AttentionStage(nn.Module):
    """Two layers (global ids 5 and 6) around the reference attention op, which is always a break."""

    def __init__(self) -> None:
        super().__init__()
        cfg = REFERENCE_CONFIGS["tiny"]
        self.hq, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        torch.manual_seed(0)
        self.qkv = nn.ModuleList(
            nn.Linear(cfg.hidden_size, (self.hq + 2 * self.hkv) * self.d) for _ in range(2)
        )
        self.o = nn.ModuleList(nn.Linear(self.hq * self.d, cfg.hidden_size) for _ in range(2))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for i, layer_id in enumerate((5, 6)):
            qkv = self.qkv[i](h)
            q, k, v = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
            a = torch.ops.ppcompile.attention(
                q.view(-1, self.hq, self.d), k.view(-1, self.hkv, self.d), v.view(-1, self.hkv, self.d),
                layer_id,
            )
            h = h + self.o[i](a.view(-1, self.hq * self.d))
        return h


def test_reference_attention_breaks_see_live_batches() -> None:
    cfg = REFERENCE_CONFIGS["tiny"]
    m = AttentionStage()
    c = torch.compile(m, backend="pp_breakable", dynamic=True, fullgraph=True,
                      options={"capture_sizes": SIZES, "graph_mode": "emulate",
                               "fold_graph_ops": 0})  # keep the tiny middle graph
    for seq_lens in ([3, 2], [4], [1, 2, 3, 2], [6, 6, 4], [9, 9], [2, 1]):
        n = sum(seq_lens)
        h = torch.randn(n, cfg.hidden_size)
        with set_forward_context(make_forward_context(seq_lens, cfg, (5, 6))) as fc:
            got = c(h)
            caches = {i: t.clone() for i, t in fc.kv_caches.items()}
        with set_forward_context(make_forward_context(seq_lens, cfg, (5, 6))) as fc:
            want = m(h)
        torch.testing.assert_close(got, want)
        for i in (5, 6):
            torch.testing.assert_close(caches[i], fc.kv_caches[i])
    rt = _runtime()
    assert [s.is_graph for s in rt.segments] == [True, False, True, False, True]
    assert counters.replays == 5 and counters.eager_runs == 1


# ----------------------------------------------------------------------------------------- emulator teeth
def test_emulator_catches_a_missing_copy_in() -> None:
    x, r = _inputs(6, seed=7)

    def skip_copy_in(category: str, fn: Any) -> Any:
        return (lambda buf, src, *a: None if src is x or src is r else fn(buf, src, *a)
                ) if category == "copy-in" else fn

    m = Stage()
    c = _compile(m)
    _check(c, m, 5)  # with copy-in: correct
    with _runtime().instrumented(skip_copy_in):
        got, _ = c(x, r)  # x and r are not copied in: the static buffers still hold the last call's rows
    want, _ = m(x, r)
    assert not torch.allclose(got, want), "a runtime without copy-in must give wrong answers under emulation"
    _check(c, m, 6, seed=7)


def test_buckets_share_graph_output_memory_and_outputs_last_until_the_next_call() -> None:
    """As graphs in one pool whose outputs nobody holds: every bucket's outputs live in the memory of
    the largest bucket's, each segment runs once at capture, and any call overwrites earlier views
    (``owned_outputs=False``)."""
    m = Stage()
    c = _compile(m, owned_outputs=False)
    first, _ = _check(c, m, 12)  # bucket 16
    state = _state(_runtime())
    for st in (st for st in _runtime().program.steps if st.segment.is_graph):
        biggest = state.executor._captured[(st.index, 16)].outputs
        for b in SIZES:
            for out, big in zip(state.executor._captured[(st.index, b)].outputs, biggest):
                assert out.untyped_storage().data_ptr() == big.untyped_storage().data_ptr()
                assert out.shape[0] == b
    kept = first.clone()
    second, _ = _check(c, m, 6, seed=3)  # bucket 8: overwrites bucket 16's outputs too
    assert not torch.allclose(first, kept)
    torch.testing.assert_close(first[:6], second)
    _check(c, m, 12, seed=4)  # and back: each bucket still computes its own answer


def test_capture_runs_each_graph_segment_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Smaller buckets view the largest bucket's outputs: capture costs one run per segment."""
    calls: list[int] = []
    original = EmulatedGraphExecutor.capture

    def counting(index: int, fn: Any) -> Any:
        def run(*args: Any) -> Any:
            calls.append(index)
            return fn(*args)
        return run

    def capture_counting(self: EmulatedGraphExecutor, key: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return original(self, key, counting(key[0], fn), *args, **kwargs)

    monkeypatch.setattr(EmulatedGraphExecutor, "capture", capture_counting)
    m = Stage()
    c = _compile(m)
    with counters.expect(captures=2 * len(SIZES), replays=1):
        _check(c, m, 5)
    assert sorted(calls) == sorted(_graph_steps(_runtime()) * 2)  # one capture run + one replay each


def test_debug_turns_a_shared_table_into_a_clear_error() -> None:
    m = Stage()
    c = _compile(m, debug=True)
    _check(c, m, 12)
    state = _state(_runtime())
    state.tables[8] = state.tables[16]
    with pytest.raises(ReplayAddressError, match="at bucket 8"):
        c(*_inputs(6, seed=3))


def test_views_are_valid_until_the_next_call() -> None:
    """Invariant 4: with ``owned_outputs=False``, outputs are views into static outputs that the next call
    overwrites."""
    m = Stage()
    c = _compile(m, owned_outputs=False)
    first, _ = _check(c, m, 5, seed=1)
    kept = first.clone()
    second, _ = _check(c, m, 6, seed=2)  # same bucket (8), other inputs
    assert not torch.allclose(first, kept), "the emulator must expose outputs overwritten by the next call"
    torch.testing.assert_close(first, second[:5])


@pytest.mark.parametrize("options", [{}, {"owned_outputs": True}], ids=["default", "owned"])
def test_owned_outputs_survive_the_next_call(options: dict[str, Any]) -> None:
    m = Stage()
    c = _compile(m, **options)
    first, first2 = _check(c, m, 5, seed=1)
    kept, kept2 = first.clone(), first2.clone()
    _check(c, m, 6, seed=2)
    _check(c, m, 5, seed=3)
    assert torch.equal(first, kept) and torch.equal(first2, kept2)


def test_debug_detects_reading_a_stale_view() -> None:
    m = Stage()
    c = _compile(m, owned_outputs=False, debug=True)
    first, _ = _check(c, m, 5, seed=1)
    _check(c, m, 6, seed=2)
    with pytest.raises(RuntimeError, match="stale"):
        _ = first + 0


# ----------------------------------------------------------------------------------------- traffic
def test_each_stage_records_the_token_counts_it_serves(tmp_path: Any) -> None:
    """Graphed, padded-eager and above-the-cap forwards all count, per stage and process-wide; the report
    scores the traffic against the stage's buckets."""
    import json

    before = ppcompile.token_histogram()
    m = Stage()
    c = _compile(m, dump_dir=str(tmp_path))
    for n in (6, 5, 5, 1 + SIZES[-1], 3):  # not 8 first: Dynamo would specialise the width-8 duck size
        _check(c, m, n)
    rt = _runtime()
    assert rt.traffic.counts() == {6: 1, 5: 2, 17: 1, 3: 1}
    after = ppcompile.token_histogram().counts()
    assert {n: after.get(n, 0) - before.counts().get(n, 0) for n in (3, 5, 6, 17)} == rt.traffic.counts()
    report = build_report(rt)["traffic"]
    assert report["forwards"] == 5 and report["counts"] == {"3": 1, "5": 2, "6": 1, "17": 1}
    # 6 -> 8, 5 -> 8 twice, 3 -> 4: (2 + 3 + 3 + 1) padded rows over 6 + 5 + 5 + 3 live ones; 17: eager.
    assert report["traffic_weighted_waste"] == round(9 / 19, 4) and report["graphed_fraction"] == 0.8
    publish_report(rt)
    (path,) = tmp_path.glob("*/report.json")
    assert json.loads(path.read_text())["traffic"]["forwards"] == 5


# ----------------------------------------------------------------------------------------- capture policies
@pytest.mark.parametrize("graph_mode", ["emulate", "eager"])
def test_lazy_capture_captures_a_bucket_at_its_first_use(graph_mode: str) -> None:
    m = Stage()
    c = _compile(m, capture="lazy", graph_mode=graph_mode)
    with counters.expect(captures=2, replays=1):  # two graph segments, one bucket
        _check(c, m, 6)
    rt = _runtime()
    assert rt.captured_buckets() == {0: (8,)}
    for n, new in ((7, 0), (3, 2), (12, 2), (5, 0), (16, 0), (2, 0)):  # buckets 8, 4, 16, 8, 16, 4
        with counters.expect(captures=new, replays=1):
            _check(c, m, n)
    assert rt.captured_buckets() == {0: (4, 8, 16)}


def test_a_capture_budget_spends_on_the_most_served_buckets_first() -> None:
    from ppcompile.planning.traffic import process_histogram

    m = Stage()
    c = _compile(m, capture="lazy", capture_budget_s=60.0)
    with counters.expect(captures=6):  # the whole ladder fits the budget
        _check(c, m, 6)
    assert _runtime().captured_buckets() == {0: (4, 8, 16)}
    traffic = process_histogram()
    saved = traffic.copy()
    traffic.reset()
    try:
        for n in [3] * 10 + [12] * 2:  # bucket 4 serves 30 tokens, bucket 16 serves 24
            traffic.record(n)
        assert _runtime().bucket_values() == [4, 16, 8]
    finally:
        traffic.reset()
        traffic.merge(saved)


def test_a_tiny_capture_budget_captures_the_needed_bucket_only() -> None:
    m = Stage()
    c = _compile(m, capture="lazy", capture_budget_s=1e-9)
    with counters.expect(captures=2):
        _check(c, m, 6)
    assert _runtime().captured_buckets() == {0: (8,)}


def _fail_capture_at(bucket: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: the emulated executor fails every capture at ``bucket`` ("no memory")."""
    original = EmulatedGraphExecutor.capture

    def fail(self: Any, key: Any, *args: Any, **kwargs: Any) -> Any:
        if key[1] == bucket:
            raise RuntimeError(f"no memory for bucket {bucket}")
        return original(self, key, *args, **kwargs)

    monkeypatch.setattr(EmulatedGraphExecutor, "capture", fail)


def test_a_failed_lazy_capture_leaves_the_other_buckets_serving(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    m = Stage()
    c = _compile(m, capture="lazy")
    _check(c, m, 6)
    _fail_capture_at(16, monkeypatch)
    for _ in range(2):
        with counters.expect(replays=0, eager_runs=1):
            _check(c, m, 12)
    with counters.expect(replays=1, eager_runs=0):
        _check(c, m, 7)
    warnings = [r for r in caplog.records if "capture of bucket 16 failed" in r.getMessage()]
    assert len(warnings) == 1 and "no memory for bucket 16" in warnings[0].getMessage()
    assert "bucket capture failed" in warnings[0].getMessage()  # the cause, named
    assert _runtime().captured_buckets() == {0: (8,)}
    assert list(_runtime().fall_offs()) == ["bucket capture failed"]
    assert counters.fall_offs == {"bucket capture failed": 1}


def test_a_budgeted_capture_failing_at_another_bucket_keeps_the_requested_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A capture budget captures the needed bucket, then others: when a later one fails, only that one
    runs eagerly; the needed bucket, captured fine, replays (it was marked failed and forgotten while
    its table stayed)."""
    m = Stage()
    c = _compile(m, capture="lazy", capture_budget_s=60.0)
    _fail_capture_at(16, monkeypatch)
    with counters.expect(replays=1, eager_runs=0, fall_offs={"bucket capture failed": 1}):
        _check(c, m, 6)  # bucket 8 first, then the budget goes on to 16 (fails) and 4
    for n, replays in ((7, 1), (12, 0), (3, 1)):
        with counters.expect(replays=replays, eager_runs=1 - replays):
            _check(c, m, n)
    (state,) = _runtime().instances()
    assert 8 in state.captured_buckets and 16 not in state.captured_buckets
    assert list(state.failed_buckets) == [16]


def test_instrumented_wraps_replays_breaks_and_copy_in_only_inside_the_block() -> None:
    m = Stage()
    c = _compile(m)
    _check(c, m, 5)
    rt = _runtime()
    calls: dict[str, int] = {}

    def wrap(category: str, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[category] = calls.get(category, 0) + 1
            return fn(*args, **kwargs)
        return counted

    for _ in range(2):
        with rt.instrumented(wrap):
            _check(c, m, 6)
    # Per call: two graph replays, one break, x and residual copied in, the break's output bridged.
    assert calls == {"graph replays": 2 * 2, "break segments": 2, "copy-in": 2 * 2, "bridge copies": 2}
    before = dict(calls)
    _check(c, m, 7)
    assert calls == before  # outside the block: the plain code

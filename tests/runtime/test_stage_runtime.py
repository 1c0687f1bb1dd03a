"""``StageRuntime`` through the ``pp_breakable`` backend on the mixer stage (``mixer_runtime.py``):
numerics in each graph mode, counters, the invariants of a call (live rows for breaks, zeroed padding,
live-size outputs, one instance per module state) and the traffic it records. Capture policies and
failures: ``test_capture_policies.py``; graph semantics and output lifetimes: ``test_graph_semantics.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from mixer_runtime import (
    SIZES,
    H,
    HalfStage,
    Stage,
    check,
    compile_stage,
    graph_steps,
    inputs,
    only_state,
    seen_rows,
    symbolic_runtime,
)
from torch import nn

import ppcompile
from ppcompile import counters
from ppcompile.debug import build_report, publish_report
from ppcompile.models import REFERENCE_CONFIGS, make_forward_context, set_forward_context
from ppcompile.runtime.executors import EagerExecutor, EmulatedGraphExecutor

pytestmark = pytest.mark.usefixtures("fresh_mixer")


# ----------------------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("mode", ["emulate", "eager"])
def test_graph_modes_match_eager_across_token_counts(mode: str) -> None:
    m = Stage()
    c = compile_stage(m, graph_mode=mode)
    for i, n in enumerate([5, 1, 4, 8, 9, 16, 17, 40, 2, 3, 12, 5]):
        check(c, m, n, seed=i)
    rt = symbolic_runtime(m)
    assert rt.graph_mode == mode
    assert rt.eager_reason is None
    executor = only_state(rt).executor
    assert isinstance(executor, EagerExecutor if mode == "eager" else EmulatedGraphExecutor)
    assert counters.replays == 9 and counters.replays_by_bucket == {4: 3, 8: 3, 16: 3}


@pytest.mark.parametrize("mode", ["none", "auto"])  # auto on CPU: the live path, faster than the emulation
def test_graph_mode_none_runs_segments_at_live_size_without_buffers(mode: str) -> None:
    m = Stage()
    c = compile_stage(m, graph_mode=mode)
    counts = [5, 1, 4, 8, 9, 16, 17, 40]  # inside, at and one past buckets, above the cap
    with counters.expect(replays=0, captures=0, eager_runs=len(counts), replays_by_bucket={}):
        for i, n in enumerate(counts):
            check(c, m, n, seed=i)
    rt = symbolic_runtime(m)
    assert rt.graph_mode == "none" and "graph_mode='none'" in (rt.eager_reason or "")
    assert (f"graph_mode='{mode}'" in (rt.eager_reason or "")) and rt.config.graph_mode == mode
    assert rt.instances() == ()  # no static buffers, no executor: nothing was allocated for graphs
    assert seen_rows[-1] == 40  # break ops see the live rows, nothing padded


def test_structure_and_describe() -> None:
    m = Stage()
    c = compile_stage(m)
    check(c, m, 5)
    rt = symbolic_runtime(m)
    assert [s.is_graph for s in rt.segments] == [True, False, True]
    assert rt.plan.sizes == (4, 8, 16)
    text = rt.describe()
    assert "3 segments" in text and "graph mode emulate" in text and "pptest_rt" in text
    assert len(rt.program.input_buffers) == 2 and len(rt.program.bridge_buffers) == 1


def test_debug_mode_matches_eager() -> None:
    m = Stage()
    c = compile_stage(m, debug=True)
    for i, n in enumerate([5, 4, 8, 9, 16, 3]):
        check(c, m, n, seed=i)
    assert counters.replays == 6


# ----------------------------------------------------------------------------------------- counters
def test_counters_per_call() -> None:
    m = Stage()
    c = compile_stage(m)
    n_graph = len(SIZES) * 2  # 2 graph segments x 3 buckets, all captured at the first graph call
    with counters.expect(replays=1, eager_runs=0, captures=n_graph, backend_compiles=1,
                         replays_by_bucket={8: 1}):
        check(c, m, 5)
    assert graph_steps(symbolic_runtime(m)) == [0, 2]
    with counters.expect(replays=1, eager_runs=0, captures=0, replays_by_bucket={8: 1}):
        check(c, m, 8)
    with counters.expect(replays=1, eager_runs=0, captures=0, replays_by_bucket={16: 1}):
        check(c, m, 9)
    with counters.expect(replays=1, eager_runs=0, captures=0, replays_by_bucket={16: 1}):
        check(c, m, 16)
    with counters.expect(replays=0, eager_runs=1, captures=0, replays_by_bucket={}):
        check(c, m, 17)  # above the cap
    with counters.expect(replays=1, eager_runs=0, captures=0, replays_by_bucket={4: 1}):
        check(c, m, 2)
    with counters.expect(replays=1, eager_runs=0, captures=0, backend_compiles=0, replays_by_bucket={4: 1}):
        check(c, m, 4)


def test_padding_guard_runs_eagerly() -> None:
    m = Stage()
    c = compile_stage(m, capture_sizes=[16], max_padding_factor=2.0)
    with counters.expect(replays=1, eager_runs=0, replays_by_bucket={16: 1}):
        check(c, m, 9)
    with counters.expect(replays=0, eager_runs=1, captures=0):
        check(c, m, 7)  # 16 > 2 * 7
    assert symbolic_runtime(m).plan.eager_reason(7) is not None


# ----------------------------------------------------------------------------------------- invariants
def test_break_op_sees_live_rows_only() -> None:
    m = Stage()
    c = compile_stage(m)
    for n in [5, 3, 8, 9, 13, 16, 17, 2]:
        seen_rows.clear()
        c(*inputs(n))
        assert seen_rows == [n], f"break op saw {seen_rows} rows for {n} live tokens"


def test_padding_rows_of_static_buffers_are_zero() -> None:
    m = Stage()
    c = compile_stage(m)
    check(c, m, 16)
    check(c, m, 8)
    state = only_state(symbolic_runtime(m))
    bufs = [*state.input_buffers.values(), *state.bridge_buffers.values()]
    assert len(bufs) == 3 and all(b.shape[0] == 16 for b in bufs)
    assert all(b[:8].abs().sum() > 0 for b in bufs)
    check(c, m, 5)  # bucket 8: rows [5:8] must be zeroed again
    for b in bufs:
        assert b[:5].abs().sum() > 0
        assert not b[5:8].any()
    check(c, m, 3)  # bucket 4
    for b in bufs:
        assert not b[3:4].any()


def test_inputs_not_modified_and_outputs_have_live_shapes() -> None:
    m = Stage()
    c = compile_stage(m)
    for n in [5, 8, 11]:
        x, r = inputs(n)
        x0, r0 = x.clone(), r.clone()
        out, out2 = c(x, r)
        assert out.shape == (n, H) and out2.shape == (n, H)
        assert torch.equal(x, x0) and torch.equal(r, r0)


def test_two_instances_share_one_compile_but_not_graphs() -> None:
    m1, m2 = Stage(seed=1), Stage(seed=2)
    c1, c2 = compile_stage(m1), compile_stage(m2)
    for i, n in enumerate([5, 6, 8, 3, 12, 7]):
        check(c1, m1, n, seed=i)
        check(c2, m2, n, seed=i)
    assert counters.backend_compiles == 1
    rt = symbolic_runtime(m1)
    assert len(rt.instances()) == 2
    ids = [{id(t) for t in s.module_state} for s in rt.instances()]
    assert ids[0] == {id(p) for p in m1.parameters()} or ids[1] == {id(p) for p in m1.parameters()}
    assert ids[0].isdisjoint(ids[1])
    assert counters.captures == 2 * len(SIZES) * 2


def test_inference_mode_calls_use_graphs_and_match() -> None:
    m = Stage()
    c = compile_stage(m)
    with torch.inference_mode():
        for i, n in enumerate([5, 16, 3, 9, 17]):
            check(c, m, n, seed=i)
    assert counters.replays == 4 and counters.eager_runs == 1
    runtime = symbolic_runtime(m)
    (state,) = runtime.instances()
    # Buffers follow the caller's mode, so graph outputs are inference tensors like eager's.
    assert all(b.is_inference() for b in (*state.input_buffers.values(), *state.bridge_buffers.values()))
    with torch.no_grad():  # outside inference mode: plain buffers (Dynamo may also recompile)
        check(c, m, 9, seed=7)
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
    c = compile_stage(m)
    for n in [5, 8, 3, 13]:
        x = torch.randn(n, H)
        got = c(x)
        for g, w in zip(got, m(x)):
            assert g.shape == (H, n)
            torch.testing.assert_close(g, w)
    assert counters.replays == 4


def test_graph_mode_cuda_on_cpu_raises_atcompile_stage() -> None:
    m = Stage()
    c = compile_stage(m, graph_mode="cuda")
    with pytest.raises(Exception, match="graph_mode") as info:
        c(*inputs(5))
    chain = [info.value, getattr(info.value, "inner_exception", None), info.value.__cause__]
    assert any(isinstance(e, ValueError) for e in chain), chain
    assert "not on a CUDA device" in str(info.value)


def test_autograd_enabled_runs_eagerly_and_matches() -> None:
    m = Stage()
    c = compile_stage(m)
    with torch.enable_grad():
        x, r = inputs(5)
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
            check(c, m, 8)


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
    rt = symbolic_runtime(m)
    assert [s.is_graph for s in rt.segments] == [True, False, True, False, True]
    assert counters.replays == 5 and counters.eager_runs == 1


# ----------------------------------------------------------------------------------------- emulator teeth
# ----------------------------------------------------------------------------------------- traffic
def test_each_stage_records_the_token_counts_it_serves(tmp_path: Any) -> None:
    """Graphed, padded-eager and above-the-cap forwards all count, per stage and process-wide; the report
    scores the traffic against the stage's buckets."""
    import json

    before = ppcompile.token_histogram()
    m = Stage()
    c = compile_stage(m, dump_dir=str(tmp_path))
    for n in (6, 5, 5, 1 + SIZES[-1], 3):  # not 8 first: Dynamo would specialise the width-8 duck size
        check(c, m, n)
    rt = symbolic_runtime(m)
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

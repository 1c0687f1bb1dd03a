"""``DistributedStage`` over gloo on loopback: 2 and 4 ranks equal the single-process eager reference.

Each test spawns its ranks with ``spawn_ranks`` (forkserver: the ranks fork from one process that imported
torch once). The workers are module-level so that the ranks can import them by name.
"""

from __future__ import annotations

import datetime
import random
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from stage_doubles import EmbedsFirstStage

import ppcompile
from ppcompile.cli.main import main as ppcompile_cli
from ppcompile.models import REFERENCE_CONFIGS, ModelConfig, make_batch, make_stage
from ppcompile.pipeline import (
    DistributedStage,
    InProcessPipeline,
    MicroBatch,
    RankError,
    init_parallel_groups,
    spawn_ranks,
)

CFG = REFERENCE_CONFIGS["tiny"]  # 4 layers, hidden 64: hidden_states + residual proxies
TOPK_CFG = REFERENCE_CONFIGS["topk"].replace(num_layers=4)  # adds an int32 topk_indices proxy
SLOW_S = 0.1  # the slow receiver sleeps this long before each batch, so its sender would run ahead
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def _stream(seed: int, count: int) -> list[list[int]]:
    """Fixed head (consecutive graph-served batches per bucket, 1 token, above every cap), random tail."""
    rng = random.Random(seed)
    head = [[16], [12, 4], [20], [3, 14], [1], [5], [40], [70]]
    tail = []
    for _ in range(count):
        total = rng.randint(2, 72)
        cuts = sorted(rng.sample(range(1, total), min(total - 1, rng.randint(0, 2))))
        tail.append([b - a for a, b in zip([0, *cuts], [*cuts, total])])
    return head + tail


def _reference(cfg: ModelConfig, world: int, stream: list[list[int]]) -> list[torch.Tensor]:
    eager = InProcessPipeline(cfg, world, compiled=False)
    out = []
    with torch.inference_mode():
        for i, lens in enumerate(stream):
            ids, pos, _ = make_batch(cfg, lens, 0, world, seed=i)
            out.append(eager(ids, pos, lens).clone())
    return out


def _pipeline_worker(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """Runs ``job["stream"]`` through this rank (``DistributedStage.run`` at ``job["depth"]``); returns
    its paths, what it sent and (last rank) cloned logits."""
    torch._dynamo.reset()
    ppcompile.counters.reset()
    cfg: ModelConfig = job["cfg"]
    stage_module = None
    if job.get("embeds") and rank == 0:
        stage_module = EmbedsFirstStage(make_stage(cfg, 0, world))
    options = {"graph_mode": "emulate", **job["options"][rank]}  # the graph path ("auto": live on CPU)
    stage = DistributedStage(cfg, options=options, stage=stage_module, send_mode=job.get("send_mode", "ring"),
                             depth=job.get("depth", 1))
    stage.in_flight = job.get("in_flight", stage.in_flight)  # a test may break the send-safety rule

    def micro_batches() -> Any:
        for i, lens in enumerate(job["stream"]):
            ids, pos, _ = make_batch(cfg, lens, 0, world, seed=i)
            embeds = stage_module.inner.embed_tokens(ids) if stage_module is not None else None
            yield MicroBatch(pos, lens, input_ids=ids, inputs_embeds=embeds)

    paths, logits = [], []
    with torch.inference_mode():
        for out in stage.run(micro_batches()):
            assert stage.trace is not None
            paths.append(stage.trace.path)
            if out is not None:
                logits.append(out.clone())
            if rank == job.get("slow_rank"):
                time.sleep(SLOW_S)
    return {"paths": paths, "logits": logits, "compiles": ppcompile.counters.backend_compiles,
            "in_flight": stage.max_batches_in_flight, "p2p": dict(stage.p2p_calls)}


def _failing_worker(rank: int, world: int, fail_rank: int, fail_step: int) -> None:
    stage = DistributedStage(CFG, compiled=False)
    for i in range(6):
        if rank == fail_rank and i == fail_step:
            raise ValueError(f"deliberate failure in rank {rank} at step {i}")
        ids, pos, _ = make_batch(CFG, [4, 3], 0, world, seed=i)
        stage(pos, [4, 3], input_ids=ids)
    stage.wait_sends()


def _stalled_worker(rank: int, world: int) -> None:
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=2))
    stage = DistributedStage(CFG, compiled=False, group=group)
    if rank == 0:
        time.sleep(120)  # never sends: rank 1's recv must time out, not hang
    ids, pos, _ = make_batch(CFG, [5], 0, world)
    stage(pos, [5], input_ids=ids)


def _check_logits(got: list[torch.Tensor], want: list[torch.Tensor], stream: list[list[int]]) -> None:
    assert len(got) == len(want) == len(stream)
    for lens, g, w in zip(stream, got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0, msg=lambda m, lens=lens: f"seq_lens {lens}: {m}")


def test_four_ranks_mixed_paths_and_slow_receiver_match_eager() -> None:
    """Ranks with different buckets (some replay while others fall back), int32 proxies, a slow rank,
    send_mode='wait' (no forward while a send is in flight)."""
    stream = _stream(seed=4, count=5)
    options = [
        {"capture_sizes": [4, 8, 16, 32, 64]},
        {"capture_sizes": [16, 32]},  # small batches fail its padding guard, above 32 it is eager
        {"max_capture_tokens": 24},
        {"capture_sizes": [64]},
    ]
    job = {"cfg": TOPK_CFG, "stream": stream, "options": options, "slow_rank": 2, "send_mode": "wait"}
    results = spawn_ranks(_pipeline_worker, 4, args=(job,), threads=1, timeout_s=120)
    _check_logits(results[-1]["logits"], _reference(TOPK_CFG, 4, stream), stream)
    paths = [r["paths"] for r in results]
    steps = list(zip(*paths))
    assert any(len(set(step)) == 2 for step in steps), steps  # some ranks replay, others fall back
    assert all("graph" in p and "eager" in p for p in paths), paths
    # 1 token: Dynamo's static 1-token graph, served by the symbolic graph's buckets: bucket 1 on rank 2,
    # the padding guard elsewhere
    assert steps[4] == ("eager", "eager", "graph", "eager")
    assert steps[5] == ("graph", "eager", "graph", "eager")  # 5 tokens: buckets 8 | 16 | 8 | 64
    assert steps[6] == ("graph", "eager", "eager", "graph")  # 40 tokens: buckets 64 | - | - | 64
    # received proxies are standalone tensors: no recompile beyond the first call and the 1-token graph
    assert all(r["compiles"] <= 2 for r in results), [r["compiles"] for r in results]
    assert all(r["in_flight"] == 0 for r in results), [r["in_flight"] for r in results]


def test_two_ranks_embeds_stage_copy_mode_match_eager() -> None:
    """A first stage bound by signature (``inputs_embeds`` only) and owned-copy sends to a slow rank."""
    stream = _stream(seed=2, count=2)
    options = [{"capture_sizes": [8, 16, 32]}, {"capture_sizes": [16, 32, 64]}]
    job = {"cfg": CFG, "stream": stream, "options": options, "slow_rank": 1, "embeds": True,
           "send_mode": "copy", "depth": 2}
    results = spawn_ranks(_pipeline_worker, 2, args=(job,), threads=1, timeout_s=120)
    _check_logits(results[-1]["logits"], _reference(CFG, 2, stream), stream)
    assert results[0]["logits"] == []
    assert all("graph" in r["paths"] for r in results)


def test_ring_mode_keeps_a_batch_on_the_wire_while_the_next_runs_and_matches_eager() -> None:
    """send_mode='ring' at depth 1: a sender runs micro-batch i + 1 while i's packed send waits for a slow
    receiver, and the logits equal eager's; each micro-batch is one message."""
    stream = _stream(seed=3, count=4)
    options = [{"capture_sizes": [8, 16, 32, 64]}, {"capture_sizes": [8, 16, 32, 64]},
               {"capture_sizes": [16, 64]}]
    job = {"cfg": CFG, "stream": stream, "options": options, "slow_rank": 2}
    results = spawn_ranks(_pipeline_worker, 3, args=(job,), threads=1, timeout_s=120)
    _check_logits(results[-1]["logits"], _reference(CFG, 3, stream), stream)
    assert all("graph" in r["paths"] for r in results)
    assert [r["in_flight"] for r in results[:2]] == [1, 1]  # a micro-batch on the wire as the next one ran
    for r in results[:2]:  # one send per micro-batch (hidden_states + residual packed), the spec once
        assert r["p2p"]["send"] == len(stream), r["p2p"]
    for r in results[1:]:
        assert r["p2p"]["recv"] == len(stream), r["p2p"]


def test_reusing_a_send_buffer_before_its_send_completed_gives_wrong_logits() -> None:
    """The ring has teeth: with one send buffer and two micro-batches allowed in flight, a sender packs
    micro-batch i + 1 over i while a slow receiver has not read i yet."""
    stream = _stream(seed=3, count=4)
    options = [{"capture_sizes": [8, 16, 32, 64]}, {"capture_sizes": [8, 16, 32, 64]},
               {"capture_sizes": [16, 64]}]
    job = {"cfg": CFG, "stream": stream, "options": options, "slow_rank": 2, "in_flight": 1}
    results = spawn_ranks(_pipeline_worker, 3, args=(job,), threads=1, timeout_s=120)
    want = _reference(CFG, 3, stream)
    wrong = [i for i, (g, w) in enumerate(zip(results[-1]["logits"], want))
             if not torch.allclose(g, w, atol=1e-5)]
    assert wrong, "a send buffer packed again while its send was in flight must corrupt a micro-batch"


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_pp4_at_depth_matches_eager_on_a_random_stream(depth: int) -> None:
    """PP4 over gloo with ``depth`` micro-batches in flight per rank (receives posted ahead, packed sends
    outstanding) and a slow last rank: logits equal the in-process eager reference."""
    stream = _stream(seed=10 + depth, count=8)
    options = [{"capture_sizes": [8, 16, 32, 64]}] * 4
    job = {"cfg": TOPK_CFG, "stream": stream, "options": options, "slow_rank": 3, "depth": depth}
    results = spawn_ranks(_pipeline_worker, 4, args=(job,), threads=1, timeout_s=180)
    _check_logits(results[-1]["logits"], _reference(TOPK_CFG, 4, stream), stream)
    for r in results[:3]:
        assert r["p2p"]["send"] == len(stream), r["p2p"]  # hidden_states, residual, topk_indices: 1 message
        assert 1 <= r["in_flight"] <= depth, r["in_flight"]
    assert results[2]["in_flight"] == depth  # the slow receiver's sender fills its ring


def test_send_modes_and_depth_are_checked() -> None:
    with pytest.raises(ValueError, match="send_mode must be one of"):
        DistributedStage(CFG, send_mode="fast")
    with pytest.raises(ValueError, match="depth must be an int >= 1"):
        DistributedStage(CFG, depth=0)


def test_failing_rank_fails_the_run_with_its_error() -> None:
    start = time.monotonic()
    with pytest.raises(RankError, match="deliberate failure in rank 1 at step 2") as info:
        spawn_ranks(_failing_worker, 3, args=(1, 2), threads=1, timeout_s=60)
    assert info.value.rank == 1
    assert "_failing_worker" in str(info.value)  # the rank's traceback comes along
    assert time.monotonic() - start < 60  # the neighbours blocked on rank 1 were terminated, not awaited


def test_process_group_timeout_turns_a_stalled_peer_into_an_error() -> None:
    with pytest.raises(RankError) as info:
        spawn_ranks(_stalled_worker, 2, threads=1, timeout_s=60)
    assert info.value.rank == 1
    text = str(info.value).lower()
    assert "timed out" in text and "recv" in text, info.value  # gloo: "Timed out waiting 2000ms for recv"


def test_demo_distributed_spawns_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m ppcompile demo --pp 2 --depth 2 --distributed`` (in this process; the ranks are
    spawned)."""
    argv = ["demo", "--distributed", "--config", "tiny", "--pp", "2", "--depth", "2", "--capture-sizes",
            "4,8,16", "--tokens", "1,8,9,3+5+7,20"]
    assert ppcompile_cli(argv) == 0
    out = capsys.readouterr().out
    assert "PP2, 2 micro-batches in flight per rank over torch.distributed (gloo, 2 processes)" in out, out
    assert "'graph_mode': 'emulate'" in out, out  # the demo's graph path on CPU ("auto" would be live-size)
    assert "graph x2" in out and "eager x2" in out, out
    assert "OK: 0 of 5" in out, out
    # warm-up compiles every rank before the stream; then only the 1-token batch gets a graph of its own
    assert out.count("Dynamo compile") == 1, out


def test_stage_needs_a_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("this test process already has a process group")
    with pytest.raises(RuntimeError, match="init_pipeline_group"):
        DistributedStage(CFG)


def _tp_pp_worker(rank: int, world: int, tp_size: int, stream: list[list[int]],
                  options: dict[str, Any]) -> dict[str, Any]:
    """One rank of a TP x PP pipeline of the reference model; the last stage's ranks return their logits."""
    torch._dynamo.reset()
    groups = init_parallel_groups(tp_size)
    stage = DistributedStage(CFG, group=groups.pp_group, tp=groups.tp,
                             options={"graph_mode": "emulate", **options})
    paths, logits = [], []
    with torch.inference_mode():
        for i, lens in enumerate(stream):
            ids, pos, _ = make_batch(CFG, lens, 0, groups.pp_size, seed=i)
            out = stage(pos, lens, input_ids=ids)
            assert stage.trace is not None
            paths.append(stage.trace.path)
            if out is not None:
                logits.append(out.clone())
    stage.wait_sends()
    (runtime,) = [rt for rt in ppcompile.runtimes_of(stage.module) if rt.token_symbol is not None]
    return {"paths": paths, "logits": logits, "breaks": [s.kind for s in runtime.segments].count("break"),
            "layers": len(stage.layers), "group": runtime.agreement.size}


@pytest.mark.parametrize(("graph_mode", "segment_compiler"), [
    ("emulate", "eager"), ("eager", "eager"), ("none", "eager"), ("auto", "eager"),
    pytest.param("emulate", "inductor", marks=pytest.mark.slow),
])
def test_tp2_pp2_pipeline_matches_the_single_process_model(graph_mode: str, segment_compiler: str) -> None:
    """4 ranks: 2 stages of 2 TP ranks; every rank sends its proxies to its peer of the next stage."""
    stream = [[8], [5, 4], [16], [1], [20], [3, 9]]  # a bucket, its + 1, the cap, 1 token, above the cap
    options = {"capture_sizes": [8, 16], "segment_compiler": segment_compiler, "graph_mode": graph_mode}
    results = spawn_ranks(_tp_pp_worker, 4, args=(2, stream, options), threads=1, timeout_s=300)
    want = _reference(CFG, 2, stream)
    for rank in (2, 3):  # both TP ranks of the last stage hold the gathered logits
        got = results[rank]["logits"]
        assert len(got) == len(stream)
        for lens, g, w in zip(stream, got, want):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=0, msg=lambda m, lens=lens: f"{lens}: {m}")
    for r in results:
        assert r["breaks"] == r["layers"] and r["group"] == 2, r  # attention only: all-reduces stay graphed
    paths = [r["paths"] for r in results]
    assert paths[0] == paths[1] and paths[2] == paths[3]  # the ranks of a TP group take the same path
    if graph_mode in ("emulate", "eager"):  # the static-buffer path ("none" and CPU "auto": live size)
        assert paths[0] == ["graph", "graph", "graph", "eager", "eager", "graph"], paths[0]


def test_demo_distributed_tp_pp_spawns_four_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m ppcompile demo --pp 2 --tp 2 --distributed``: logits equal the full eager model."""
    argv = ["demo", "--distributed", "--config", "tiny", "--pp", "2", "--tp", "2", "--capture-sizes",
            "4,8,16", "--tokens", "1,8,9,3+5+7,20"]
    assert ppcompile_cli(argv) == 0
    out = capsys.readouterr().out
    assert "PP2 x TP2, 1 micro-batch in flight per rank over torch.distributed (gloo, 4 processes)" in out, \
        out
    assert "OK: 0 of 5" in out, out

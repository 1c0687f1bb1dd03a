"""vLLM as a client: a real vLLM (its CPU build) compiles a tiny Llama's stages with ``pp_breakable``.

The driver (``vllm_driver.py`` beside this file) runs in ``.venv-vllm`` (``scripts/vllm_env.sh``: vLLM pins
its own torch and transformers), once for the module: vLLM eager at PP1 for the reference tokens, then
compilation mode 2 with backend ``pp_breakable`` at PP1, PP1 again on the first's vLLM cache, and PP2
(spawned workers, one stage each), options through ``PPCOMPILE_OPTIONS``, vLLM's settings its defaults:
it compiles through Dynamo's ``aot_compile`` and stores the compile, which the restart loads. vLLM's own
uncompiled PP2 dies in its scheduler on CPU (vllm #32701), so every compiled run is compared with eager
PP1.

Without ``.venv-vllm`` the tests skip, unless ``PPCOMPILE_REQUIRE_ENGINES=1`` (CI), where that fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).with_name("vllm_driver.py")
COMPILED = ("pp1", "pp1_restart", "pp2")
RUN_TIMEOUT_S = 300  # per run of the driver (typically 15 s at PP1, 70 s at PP2 on 2 cores)
TIMEOUT_S = (1 + len(COMPILED)) * RUN_TIMEOUT_S + 120


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not PYTHON.exists():
        why = f"{PYTHON.relative_to(ROOT)} is missing: run scripts/vllm_env.sh"
        if os.environ.get("PPCOMPILE_REQUIRE_ENGINES") == "1":
            pytest.fail(f"PPCOMPILE_REQUIRE_ENGINES=1 but {why}")
        pytest.skip(why)
    work = tmp_path_factory.mktemp("vllm")
    out = work / "result.json"
    cmd = [str(PYTHON), str(DRIVER), "--out", str(out), "--work-dir", str(work),
           "--timeout", str(RUN_TIMEOUT_S)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PPCOMPILE_")}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"the vLLM driver ran past {TIMEOUT_S} s:\n{log[-4000:]}")
    assert proc.returncode == 0, f"the vLLM driver failed (exit {proc.returncode}):\n{log[-4000:]}"
    data: dict[str, Any] = json.loads(out.read_text())
    for name, run in data["runs"].items():
        assert run["rc"] == 0, f"vLLM run {name} failed (exit {run['rc']}):\n{run.get('log_tail', '')}"
    return data


def _stages(run: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(worker, stage) for every stage graph a worker of ``run`` compiled."""
    assert run["probe_error"] is None, f"could not probe the workers: {run['probe_error']}"
    return [(w, s) for w in run["workers"] for s in w["stages"]]


@pytest.mark.parametrize("name", COMPILED)
def test_tokens_match_vllm_eager(result: dict[str, Any], name: str) -> None:
    """Greedy tokens of every compiled run equal vLLM's eager PP1 run's."""
    want = result["runs"]["eager"]["tokens"]
    assert len(want) == len(result["prompt_lengths"])
    assert result["runs"][name]["tokens"] == want


@pytest.mark.parametrize("name", COMPILED)
def test_every_rank_compiled_and_replayed(result: dict[str, Any], name: str) -> None:
    """Each of the run's PP ranks compiled its stage with graphs (never always-eager) and replayed them; the
    stages together hold every decoder layer once."""
    run = result["runs"][name]
    assert run["probe_error"] is None, f"could not probe the workers: {run['probe_error']}"
    workers = run["workers"]
    assert sorted(w["rank"] for w in workers) == list(range(run["pp"]))
    layers = sorted(i for w in workers for i in w["decoder_layers"])
    assert layers == list(range(result["model"]["num_hidden_layers"]))
    for w in workers:
        assert w["stages"], f"rank {w['rank']} compiled no stage"
        for s in w["stages"]:
            assert s["eager_reason"] is None, f"rank {w['rank']} {s['stage_graph']}: {s['eager_reason']}"
            assert s["graph_mode"] == "emulate"
            assert s["captures"] > 0, f"rank {w['rank']} {s['stage_graph']} captured nothing"
        assert w["counters"]["replays"] > 0, f"rank {w['rank']} never replayed: {w['counters']}"


@pytest.mark.parametrize("name", COMPILED)
def test_at_most_one_break_per_decoder_layer(result: dict[str, Any], name: str) -> None:
    """The issue's target: one break per decoder layer (its attention, with the KV-cache write beside it);
    linears, norms and the rotary embedding stay in graph segments."""
    for w, s in _stages(result["runs"][name]):
        layers = len(w["decoder_layers"])
        ops = [f"{b['kind']}: {b['op']}" for b in s["breaks"]]
        assert len(s["breaks"]) <= layers, (
            f"rank {w['rank']} {s['stage_graph']}: {len(s['breaks'])} breaks for {layers} decoder layers: "
            f"{ops}\n{s['describe']}")


@pytest.mark.parametrize("name", COMPILED)
def test_the_layers_ppcompile_found_are_vllms(result: dict[str, Any], name: str) -> None:
    """The global layer ids ppcompile read off vLLM's attention ops (their layer-name argument, a graph
    input on torch >= 2.11) are the decoder layers vLLM gave the stage, one attention break each."""
    for w, s in _stages(result["runs"][name]):
        assert s["layer_ids"] == sorted(w["decoder_layers"]), s["describe"]
        assert sorted(i for b in s["breaks"] for i in b["layer_ids"]) == sorted(w["decoder_layers"])



def test_a_restart_loads_the_compile_vllm_stored(result: dict[str, Any]) -> None:
    """PP1 stores its compile (Dynamo's ``aot_compile``: its bytecode, and the stage graph and lowered
    stage ppcompile serializes); started again on the same vLLM cache, vLLM loads it, and neither Dynamo
    nor ppcompile's passes run (the restored stage's tokens, captures and replays: the tests above)."""
    (first,), (again,) = (result["runs"][name]["workers"] for name in ("pp1", "pp1_restart"))
    assert first["vllm_counters"] == {"num_aot_compiles": 1, "num_aot_artifacts_saved": 1,
                                      "num_aot_artifacts_loaded": 0}, result["runs"]["pp1"]["log"]
    assert again["vllm_counters"] == {"num_aot_compiles": 0, "num_aot_artifacts_saved": 0,
                                      "num_aot_artifacts_loaded": 1}, result["runs"]["pp1_restart"]["log"]
    assert (first["counters"]["backend_compiles"], again["counters"]["backend_compiles"]) == (1, 0)

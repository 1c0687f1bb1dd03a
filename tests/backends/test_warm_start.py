"""ppcompile.warm_compile: a restart reuses the stored compile (no Dynamo trace), matches eager at every
token count, and never reuses a stale artifact (model code, options, torch version); bad files are
misses, and a stage Dynamo cannot trace whole is served by torch.compile."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from stage_checks import assert_close

import ppcompile
from ppcompile.backends import warm_cache
from ppcompile.backends.segment_compilers import clear_segment_cache
from ppcompile.backends.stored_stage import StoredStageError
from ppcompile.debug.report import build_report
from ppcompile.models import ModelConfig, make_batch, make_forward_context, make_stage, set_forward_context

CFG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1,
                  head_dim=8, num_layers=4)
OPTIONS = {"graph_mode": "emulate", "capture_sizes": [4, 8]}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PPCOMPILE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _restart() -> None:
    """What a new process starts without: Dynamo's caches and ppcompile's shared segment artifacts."""
    torch._dynamo.reset()
    clear_segment_cache()


def _call(fn: Any, stage: Any, n: int) -> Any:
    _, pos, proxies = make_batch(CFG, [n], 1, 2, seed=n)
    if n > 1:
        ppcompile.mark_token_dynamic(pos, proxies)
    with torch.inference_mode(), set_forward_context(make_forward_context([n], CFG, range(2, 4))):
        return fn(None, pos, pp_proxy_tensors=proxies)


def _check(warm: ppcompile.WarmStage, stage: Any, n: int) -> None:
    assert_close(_call(warm, stage, n), _call(stage, stage, n), f"{n} tokens")


def test_a_restart_reuses_the_stored_compile_and_matches_eager() -> None:
    stage = make_stage(CFG, 1, 2)
    first = ppcompile.warm_compile(stage, OPTIONS)
    for n in (5, 1):  # a symbolic graph, and Dynamo's static one for a single token
        _check(first, stage, n)
    assert (first.loaded, first.compiled, first.fallback_reason) == (0, 2, None)
    assert first.path.is_file() and first.path.parent == ppcompile.warm_cache_dir()
    described = [rt.describe().splitlines()[1:] for rt in first.runtimes()]
    estimated = [build_report(rt)["memory"]["estimated_graph_bytes"] for rt in first.runtimes()]

    _restart()
    traces = ppcompile.counters.backend_compiles
    again = ppcompile.warm_compile(make_stage(CFG, 1, 2), OPTIONS)
    assert again.key == first.key
    for n in (5, 1, 4, 8, 9, 17):  # traced, one token, a bucket, the cap, cap + 1 and above (eager)
        _check(again, stage, n)
    assert (again.loaded, again.compiled) == (2, 0)
    assert ppcompile.counters.backend_compiles == traces  # neither Dynamo nor the passes ran again
    assert all(set(rt.compiled.record.compile_times) == {"read_back"} for rt in again.runtimes())
    # The split module comes back without traced values: the report's estimate is unknown, never 0.
    assert any(isinstance(b, int) and b > 0 for b in estimated)
    assert [build_report(rt)["memory"]["estimated_graph_bytes"] for rt in again.runtimes()] == [None, None]
    assert [rt.describe().splitlines()[1:] for rt in again.runtimes()] == described
    assert again.load_seconds() > 0


def test_an_artifact_is_read_only_when_a_call_needs_it() -> None:
    stage = make_stage(CFG, 1, 2)
    first = ppcompile.warm_compile(stage, OPTIONS)
    _call(first, stage, 5)
    _call(first, stage, 1)
    _restart()
    again = ppcompile.warm_compile(stage, OPTIONS)
    _check(again, stage, 6)
    assert (again.loaded, len(again.runtimes())) == (1, 1)  # the 1-token artifact waits for a 1-token call


def test_the_key_changes_with_options_torch_and_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    stage = make_stage(CFG, 1, 2)
    key = warm_cache.stage_key(stage, OPTIONS, None)
    assert warm_cache.stage_key(make_stage(CFG, 1, 2), OPTIONS, None) == key  # same class, state, options
    assert warm_cache.stage_key(stage, {**OPTIONS, "capture_sizes": [4]}, None) != key
    assert warm_cache.stage_key(stage, OPTIONS, "stage 1") != key
    assert warm_cache.stage_key(make_stage(CFG.replace(hidden_size=24), 1, 2), OPTIONS, None) != key
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert warm_cache.stage_key(stage, OPTIONS, None) != key


_MODEL_SOURCE = '''
import torch

class Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * {factor}
'''


def _import_model(path: Path, factor: int) -> Any:
    path.write_text(textwrap.dedent(_MODEL_SOURCE.format(factor=factor)))
    spec = importlib.util.spec_from_file_location("pp_warm_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["pp_warm_model"] = module
    spec.loader.exec_module(module)
    return module


def test_a_change_to_the_model_code_is_never_reused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    x = torch.randn(6, 8)
    ppcompile.mark_token_dynamic(x)
    try:
        model = _import_model(tmp_path / "pp_warm_model.py", 2)
        torch.manual_seed(0)
        first = ppcompile.warm_compile(model.Scale(), OPTIONS)
        with torch.no_grad():
            first(x)
        _restart()
        model = _import_model(tmp_path / "pp_warm_model.py", 3)
        torch.manual_seed(0)
        edited = model.Scale()
        again = ppcompile.warm_compile(edited, OPTIONS)
        assert again.key == first.key  # the key cannot see the code: the artifact's digests do
        with torch.no_grad(), caplog.at_level(logging.INFO, logger="ppcompile.backends.warm_cache"):
            got = again(x)
            torch.testing.assert_close(got, edited(x))
        assert (again.loaded, again.compiled) == (0, 1)
        assert "stale (changed since: pp_warm_model)" in caplog.text
    finally:
        sys.modules.pop("pp_warm_model", None)


def test_an_unreadable_or_foreign_file_is_a_miss_and_is_replaced() -> None:
    stage = make_stage(CFG, 1, 2)
    path = ppcompile.warm_compile(stage, OPTIONS).path
    path.parent.mkdir(parents=True)
    for junk in (b"not a pickle", json.dumps({"format": -1}).encode()):
        path.write_bytes(junk)
        _restart()
        warm = ppcompile.warm_compile(stage, OPTIONS)
        _check(warm, stage, 5)
        assert (warm.loaded, warm.compiled) == (0, 1)
    assert warm_cache.read_entries(warm.key)  # rewritten, readable


def _broken(data: bytes) -> Any:
    raise RuntimeError("made by another torch")


def test_an_artifact_that_does_not_load_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    stage = make_stage(CFG, 1, 2)
    first = ppcompile.warm_compile(stage, OPTIONS)
    _call(first, stage, 5)
    _restart()
    key = first.key
    (entry,) = warm_cache.read_entries(key)
    warm_cache.write_entries(key, [(b"not a Dynamo artifact", entry[1])])  # its modules unchanged
    warm = ppcompile.warm_compile(stage, OPTIONS)
    with caplog.at_level(logging.WARNING, logger="ppcompile.backends"):
        _check(warm, stage, 5)
    assert (warm.loaded, warm.compiled) == (0, 1) and "does not load" in caplog.text
    assert [data for data, _ in warm_cache.read_entries(key)] != [b"not a Dynamo artifact"]  # replaced


def test_an_artifact_that_does_not_compile_again_is_dropped(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Both stored forms inside the Dynamo artifact fail to restore (the loaders are reached only from
    torch's load of the artifact and the compiled function's first call: patched)."""
    stage = make_stage(CFG, 1, 2)
    _call(ppcompile.warm_compile(stage, OPTIONS), stage, 5)
    _restart()
    for name in ("loads_compiled_stage", "loads_stage_graph"):
        monkeypatch.setattr(f"ppcompile.backends.stored_graph.{name}", _broken)
    warm = ppcompile.warm_compile(stage, OPTIONS)
    with caplog.at_level(logging.WARNING, logger="ppcompile.backends"):
        _check(warm, stage, 5)
    assert warm.compiled == 1 and "made by another torch" in caplog.text


def test_a_lowered_stage_that_does_not_load_is_compiled_again_from_its_graph(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    stage = make_stage(CFG, 1, 2)
    _call(ppcompile.warm_compile(stage, OPTIONS), stage, 5)
    _restart()
    monkeypatch.setattr("ppcompile.backends.stored_graph.loads_compiled_stage", _broken)
    traces = ppcompile.counters.backend_compiles
    warm = ppcompile.warm_compile(stage, OPTIONS)
    with caplog.at_level(logging.WARNING, logger="ppcompile.backends.stored_graph"):
        for n in (5, 4, 9):
            _check(warm, stage, n)
    assert (warm.loaded, warm.compiled) == (1, 0)  # no Dynamo trace: the stored graph went through the passes
    assert ppcompile.counters.backend_compiles == traces + 1
    assert "a stored lowered stage does not load" in caplog.text


def test_a_stage_whose_lowered_form_cannot_be_stored_restarts_from_its_graph(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(stage: Any) -> bytes:
        raise StoredStageError("segment submod_0 runs an Inductor kernel")

    monkeypatch.setattr("ppcompile.backends.stored_graph.dumps_compiled_stage", refuse)
    stage = make_stage(CFG, 1, 2)
    _call(ppcompile.warm_compile(stage, OPTIONS), stage, 5)
    _restart()
    traces = ppcompile.counters.backend_compiles
    warm = ppcompile.warm_compile(stage, OPTIONS)
    _check(warm, stage, 5)
    assert (warm.loaded, warm.compiled, ppcompile.counters.backend_compiles) == (1, 0, traces + 1)
    assert "passes" in warm.runtimes()[0].compiled.record.compile_times


class Breaks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        torch._dynamo.graph_break()
        return torch.relu(y)


def test_a_stage_dynamo_cannot_trace_whole_is_served_by_torch_compile(
        caplog: pytest.LogCaptureFixture) -> None:
    stage = Breaks()
    warm = ppcompile.warm_compile(stage, OPTIONS)
    x = torch.randn(6, 8)
    ppcompile.mark_token_dynamic(x)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="ppcompile.backends.warm_start"):
        torch.testing.assert_close(warm(x), stage(x))
        torch.testing.assert_close(warm(x[:3]), stage(x[:3]))
    assert warm.fallback_reason is not None and "ahead-of-time compile refused it" in warm.fallback_reason
    assert "without warm restarts" in caplog.text
    assert not warm.path.exists()


def test_clear_warm_cache_deletes_every_artifact() -> None:
    stage = make_stage(CFG, 1, 2)
    _call(ppcompile.warm_compile(stage, OPTIONS), stage, 5)
    _call(ppcompile.warm_compile(stage, OPTIONS, name="another"), stage, 5)
    assert ppcompile.clear_warm_cache() == 2
    assert not ppcompile.warm_cache_dir().exists()
    assert ppcompile.clear_warm_cache() == 0


_CHILD = '''
import json, sys, torch, ppcompile
from torch._inductor import cpu_vec_isa
from ppcompile.models import ModelConfig, make_batch, make_forward_context, make_stage, set_forward_context
cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1,
                  head_dim=8, num_layers=4)
probes = []  # Inductor's CPU vector-ISA probes in this process (each ISA's own, not the AVX-512 features)
build = cpu_vec_isa.VecISA.check_build
def counted(self, code):
    if code == cpu_vec_isa.VecISA._avx_code:
        probes.append(str(self))
    return build(self, code)
cpu_vec_isa.VecISA.check_build = counted
torch.manual_seed(0)
stage = make_stage(cfg, 1, 2)
options = {"graph_mode": "emulate", "capture_sizes": [4, 8], "segment_compiler": sys.argv[1]}
warm = ppcompile.warm_compile(stage, options)
_, pos, proxies = make_batch(cfg, [5], 1, 2)
ppcompile.mark_token_dynamic(pos, proxies)
with torch.inference_mode(), set_forward_context(make_forward_context([5], cfg, range(2, 4))):
    got, want = warm(None, pos, pp_proxy_tensors=proxies), stage(None, pos, pp_proxy_tensors=proxies)
err = (got - want).abs().max().item()  # the last stage: its output is one tensor
print(json.dumps({"loaded": warm.loaded, "compiled": warm.compiled, "err": err, "isa_probes": len(probes),
                  "dynamo_traces": sum("dynamo_trace" in rt.compiled.record.compile_times
                                       for rt in warm.runtimes()),
                  "passes_run": sum("passes" in rt.compiled.record.compile_times for rt in warm.runtimes())}))
'''


def _two_starts(code: str, cache_dir: Path, *args: str) -> list[dict[str, Any]]:
    """What ``code`` printed last (JSON) in each of two fresh processes sharing ``cache_dir``, each
    with the command-line arguments ``args``; under ``"log"``, the end of what the process logged (why
    a stored artifact did not load, say), for the failure message of a test."""
    env = {**os.environ, "PPCOMPILE_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(ROOT)}
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                              timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append({**json.loads(done.stdout.strip().splitlines()[-1]), "log": done.stderr[-3000:]})
    return runs


def test_a_second_process_loads_what_the_first_stored(cache_dir: Path) -> None:
    cold, warm = _two_starts(_CHILD, cache_dir, "eager")
    assert (cold["loaded"], cold["compiled"], cold["dynamo_traces"], cold["passes_run"]) == (0, 1, 1, 1)
    assert (warm["loaded"], warm["compiled"], warm["dynamo_traces"], warm["passes_run"]) == (1, 0, 0, 0), \
        warm["log"]
    assert cold["err"] < 1e-5 and warm["err"] < 1e-5


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="Inductor probes x86 ISAs only")
def test_a_restart_loads_inductor_kernels_without_probing_the_cpu_again(cache_dir: Path) -> None:
    """The stored stage carries the first process's vector-ISA answer; the restart adopts it."""
    cold, warm = _two_starts(_CHILD, cache_dir, "inductor")
    assert (cold["loaded"], cold["compiled"], warm["loaded"], warm["compiled"]) == (0, 1, 1, 0), warm["log"]
    assert cold["isa_probes"] > 0 and warm["isa_probes"] == 0
    assert cold["err"] < 1e-5 and warm["err"] < 1e-5


_OPAQUE_CHILD = '''
import json, torch, ppcompile
from torch import nn

class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x, state=None):
        return x @ self.w

class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.mix, self.down = nn.Linear(8, 8), ppcompile.opaque_module(Mixer()), nn.Linear(8, 8)

    def forward(self, x):
        return self.down(self.mix(torch.relu(self.up(x))))

torch.manual_seed(0)
stage = Stage()
warm = ppcompile.warm_compile(stage, {"graph_mode": "emulate", "capture_sizes": [4, 8]})
x = torch.randn(5, 8)
ppcompile.mark_token_dynamic(x)
with torch.no_grad():
    err = (warm(x) - stage(x)).abs().max().item()
print(json.dumps({"loaded": warm.loaded, "compiled": warm.compiled, "err": err}))
'''


def test_a_stage_with_an_opaque_module_restarts_warm(cache_dir: Path) -> None:
    """The opaque op's key (a constant Dynamo guards) is the same in a process that builds the model
    the same way, so the stored compile applies again."""
    runs = _two_starts(_OPAQUE_CHILD, cache_dir)
    assert [(r["loaded"], r["compiled"]) for r in runs] == [(0, 1), (1, 0)], runs[1]["log"]
    assert max(r["err"] for r in runs) < 1e-5


def test_a_restart_with_inductor_segments_loads_their_kernels_without_the_passes() -> None:
    options = {**OPTIONS, "segment_compiler": "inductor"}
    stage = make_stage(CFG, 1, 2)
    first = ppcompile.warm_compile(stage, options)
    _check(first, stage, 5)
    _restart()
    compiles, traces = ppcompile.counters.segment_compiles, ppcompile.counters.backend_compiles
    again = ppcompile.warm_compile(make_stage(CFG, 1, 2), options)
    for n in (5, 4, 8, 9, 17):  # traced, a bucket, the cap, cap + 1 and above (eager)
        _check(again, stage, n)
    assert (again.loaded, again.compiled) == (1, 0)
    # Neither the passes nor a segment compile ran: the kernels were loaded by their cache keys.
    assert (ppcompile.counters.segment_compiles, ppcompile.counters.backend_compiles) == (compiles, traces)
    (runtime,) = again.runtimes()
    assert set(runtime.compiled.record.compile_times) == {"read_back"}

"""``pp_breakable`` under Dynamo's ahead-of-time compile (``torch.compile(...).aot_compile``, vLLM's default
compile on torch >= 2.10): the backend returns a stage graph torch can serialize, which serves as the
stage runtime does (eager results at every token count, replays); read back outside ``warm_compile`` it
serves with ``PPCOMPILE_OPTIONS`` when they are the options it was compiled with, and otherwise refuses
to load. A plain ``torch.compile`` still gets the stage runtime itself."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from stage_checks import assert_close
from torch._library.opaque_object import register_opaque_type
from torch._opaque_base import OpaqueBase

import ppcompile
from ppcompile.backends.bound_options import backend_with_options
from ppcompile.backends.graph_codec import GraphCodecError
from ppcompile.backends.pp_breakable import StageGraph, pp_breakable
from ppcompile.backends.segment_compilers import clear_segment_cache
from ppcompile.backends.stored_graph import StoredGraphError
from ppcompile.models import ModelConfig, make_batch, make_forward_context, make_stage, set_forward_context
from ppcompile.runtime.stage_runtime import StageRuntime
from ppcompile.torch_internals.precompile import dumps_aot

CFG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1,
                  head_dim=8, num_layers=4)
OPTIONS = {"graph_mode": "emulate", "capture_sizes": [4, 8]}
COUNTS = (5, 4, 8, 9, 17)  # the traced count, a bucket, the cap, cap + 1 and above (eager)
ROOT = Path(__file__).resolve().parents[2]


def _forward(stage: Any, positions: torch.Tensor, proxies: Any) -> Any:
    return stage(None, positions, pp_proxy_tensors=proxies)


def _run(fn: Any, stage: Any, n: int, mark: bool = False) -> Any:
    _, pos, proxies = make_batch(CFG, [n], 1, 2, seed=n)
    if mark:
        ppcompile.mark_token_dynamic(pos, proxies)
    with torch.inference_mode(), set_forward_context(make_forward_context([n], CFG, range(2, 4))):
        return fn(stage, pos, proxies)


def _aot_compile(stage: Any, backend: Any = "pp_breakable", options: Any = None) -> Any:
    """What vLLM does: ``torch.compile`` (fullgraph) with the API switched on, then ``aot_compile`` on
    the inputs of a 5-token call, token dims marked dynamic."""
    _, pos, proxies = make_batch(CFG, [5], 1, 2, seed=5)
    ppcompile.mark_token_dynamic(pos, proxies)
    with torch._dynamo.config.patch(enable_aot_compile=True):
        compiled = torch.compile(_forward, backend=backend, fullgraph=True, options=options)
    with torch.inference_mode(), set_forward_context(make_forward_context([5], CFG, range(2, 4))):
        return compiled.aot_compile(((stage, pos, proxies), {}))


def _restart() -> None:
    torch._dynamo.reset()
    clear_segment_cache()


def _load(data: bytes) -> Any:
    """Loaded where it is called, under inference mode (Dynamo's guards, rebuilt at the load, take the
    dispatch keys of the tensors they check relative to the loading thread's)."""
    with torch.inference_mode():
        return torch.compiler.load_compiled_function(io.BytesIO(data))


def _check_counts(compiled: Any, stage: Any) -> None:
    replays = ppcompile.counters.replays
    for n in COUNTS:
        assert_close(_run(compiled, stage, n), _run(_forward, stage, n), f"{n} tokens")
    assert ppcompile.counters.replays > replays
    compiled.disable_guard_check()  # as vLLM does: one graph serves every count, a single token too
    assert_close(_run(compiled, stage, 1), _run(_forward, stage, 1), "1 token")


def test_aot_compile_gets_a_serializable_stage_graph_that_matches_eager() -> None:
    stage = make_stage(CFG, 1, 2)
    compiled = _aot_compile(stage, options=OPTIONS)
    result = compiled._artifacts.compiled_fn
    assert isinstance(result, StageGraph) and isinstance(result.runtime, StageRuntime)
    assert ppcompile.stage_runtimes() == [result.runtime]
    _check_counts(compiled, stage)
    assert len(dumps_aot(compiled)) > 0


def test_a_plain_compile_gets_the_stage_runtime_and_a_wrapped_backend_is_seen_under_aot() -> None:
    got: list[Any] = []

    def recording(gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
        got.append(pp_breakable(gm, example_inputs, OPTIONS))
        return got[-1]

    stage = make_stage(CFG, 1, 2)
    plain = torch.compile(_forward, backend=recording)
    assert_close(_run(plain, stage, 5, mark=True), _run(_forward, stage, 5), "5 tokens")
    _aot_compile(stage, backend=recording)
    assert [type(r) for r in got] == [StageRuntime, StageGraph]
    bound = _aot_compile(stage, backend=backend_with_options(OPTIONS))
    assert isinstance(bound._artifacts.compiled_fn, StageGraph)


def test_read_back_with_the_same_pp_compile_options_it_serves_without_compiling(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPCOMPILE_OPTIONS", json.dumps(OPTIONS))  # as an engine passes them
    stage = make_stage(CFG, 1, 2)
    data = dumps_aot(_aot_compile(stage))
    _restart()
    traces = ppcompile.counters.backend_compiles
    loaded = _load(data)
    result = loaded._artifacts.compiled_fn
    assert isinstance(result, StageGraph) and result.runtime is None
    result.finalize_loading(object())  # the hook vLLM calls after loading: nothing to do
    _check_counts(loaded, stage)
    assert ppcompile.counters.backend_compiles == traces  # the lowered stage was read back
    assert set(result.runtime.compiled.record.compile_times) == {"read_back"}


def test_a_stored_graph_whose_lowered_stage_does_not_load_is_compiled_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPCOMPILE_OPTIONS", json.dumps(OPTIONS))
    stage = make_stage(CFG, 1, 2)
    data = dumps_aot(_aot_compile(stage))
    _restart()

    def broken(data: bytes) -> Any:
        raise RuntimeError("made by another torch")

    monkeypatch.setattr("ppcompile.backends.stored_graph.loads_compiled_stage", broken)
    traces = ppcompile.counters.backend_compiles
    loaded = _load(data)
    _check_counts(loaded, stage)
    assert ppcompile.counters.backend_compiles == traces + 1  # the passes ran on the stored graph, no trace


@pytest.mark.parametrize("now", [None, {**OPTIONS, "capture_sizes": [4]}])
def test_read_back_with_other_options_it_refuses_to_load(now: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled with options this process cannot know (``options=``, or other ``PPCOMPILE_OPTIONS``):
    loading fails cleanly, so the caller compiles again (vLLM does), and nothing stale is served."""
    stage = make_stage(CFG, 1, 2)
    data = dumps_aot(_aot_compile(stage, options=OPTIONS))
    _restart()
    if now is not None:
        monkeypatch.setenv("PPCOMPILE_OPTIONS", json.dumps(now))
    with pytest.raises(StoredGraphError, match="other options"):
        _load(data)


def test_a_foreign_or_old_artifact_refuses_to_load() -> None:
    for stored in (None, ("ppcompile-stored-stage-2", b"graph", None), ("ppcompile-stored-stage-3",)):
        with pytest.raises(StoredGraphError, match="not a stored stage graph"):
            StageGraph.deserialize_compile_artifacts(pickle.dumps(stored))


def test_a_graph_the_codec_cannot_write_compiles_and_serves_but_does_not_serialize(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(gm: torch.fx.GraphModule) -> bytes:
        raise GraphCodecError("a node's traced value is a Widget")

    monkeypatch.setattr("ppcompile.backends.pp_breakable.dumps_stage_graph", refuse)
    stage = make_stage(CFG, 1, 2)
    compiled = _aot_compile(stage, options=OPTIONS)
    assert_close(_run(compiled, stage, 5), _run(_forward, stage, 5), "5 tokens")
    with pytest.raises(StoredGraphError, match="Widget"):
        dumps_aot(compiled)


_CHILD = '''
import json, os, sys, torch, ppcompile
sys.path.insert(0, os.path.join(sys.argv[2], "tests", "backends"))
sys.path.insert(0, os.path.join(sys.argv[2], "tests"))
import test_aot_compile as t
stage = t.make_stage(t.CFG, 1, 2)
path = sys.argv[1]
if os.path.exists(path):
    compiled = t._load(open(path, "rb").read())
else:
    compiled = t._aot_compile(stage)
    compiled.save_compiled_function(path)
errs = {n: (t._run(compiled, stage, n) - t._run(t._forward, stage, n)).abs().max().item() for n in t.COUNTS}
print(json.dumps({"err": max(errs.values()), "traces": ppcompile.counters.backend_compiles,
                  "replays": ppcompile.counters.replays}))
'''


def test_a_second_process_serves_what_the_first_saved(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PPCOMPILE_OPTIONS": json.dumps(OPTIONS),
           "PPCOMPILE_CACHE_DIR": str(tmp_path / "cache")}
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "stage.bin"), str(ROOT)], env=env,
                              capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    (cold, warm) = runs
    assert (cold["traces"], warm["traces"]) == (1, 0), runs
    assert cold["err"] < 1e-5 and warm["err"] < 1e-5 and warm["replays"] > 0


class _Held(torch.nn.Module):
    """State a stage reaches outside its arguments: a buffer, and a tensor in a closure cell (an engine's
    kernel handle, say). ``torch.compile`` reads both in place; so must the ahead-of-time compile, whose
    trace drops the input sources before the backend runs (``graph_codec.restore_input_sources``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("shift", torch.randn(8))
        handle = torch.randn(8)
        self.scaled = lambda x: x * handle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scaled(torch.relu(self.lin(x) + self.shift))


def _held_call(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def test_state_outside_the_arguments_is_read_in_place_as_under_torch_compile() -> None:
    module, x = _Held(), torch.randn(6, 8)
    ppcompile.mark_token_dynamic(x)
    with torch.no_grad():
        want = module(x)
        plain_compiled = torch.compile(_held_call, backend="pp_breakable", options=OPTIONS)
        torch.testing.assert_close(plain_compiled(module, x), want)
        (plain,) = ppcompile.stage_runtimes()
        with torch._dynamo.config.patch(enable_aot_compile=True):
            compiled = torch.compile(_held_call, backend="pp_breakable", fullgraph=True, options=OPTIONS)
        aot = compiled.aot_compile(((module, x), {}))
        for n in (6, 3, 8, 9):
            torch.testing.assert_close(aot(module, x[:n]), module(x[:n]))
    runtime = aot._artifacts.compiled_fn.runtime
    assert len(plain.compiled.state_slots) == 4  # weight, bias, buffer, closure tensor
    assert runtime.compiled.state_slots == plain.compiled.state_slots


class _Tag(OpaqueBase):
    """An opaque value type lifted to a graph input, as vLLM's ``LayerName`` (a fake opaque object in the
    traced graph, which the graph codec writes as its value)."""

    def __init__(self, value: str) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Tag) and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)

    def __fx_repr__(self) -> tuple[str, dict[str, type]]:
        return f"_Tag({self.value!r})", {"_Tag": _Tag}


register_opaque_type(_Tag, typ="value", hoist=True)


@torch.library.custom_op("ppcompile_test::tagged_by_opaque_value", mutates_args=())
def _tagged(x: torch.Tensor, tag: _Tag) -> torch.Tensor:
    return x * len(tag.value)


@_tagged.register_fake
def _(x: torch.Tensor, tag: _Tag) -> torch.Tensor:
    return torch.empty_like(x)


def _tagged_call(module: torch.nn.Module, x: torch.Tensor, tag: _Tag) -> torch.Tensor:
    return _tagged(module(x), tag) + 1


def test_a_stage_with_an_opaque_value_input_is_stored_and_served_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPCOMPILE_OPTIONS", json.dumps(OPTIONS))
    module, x, tag = torch.nn.Linear(8, 8), torch.randn(6, 8), _Tag("layers.0")
    ppcompile.mark_token_dynamic(x)
    with torch.inference_mode(), torch._dynamo.config.patch(enable_aot_compile=True):
        compiled = torch.compile(_tagged_call, backend="pp_breakable", fullgraph=True)
        data = dumps_aot(compiled.aot_compile(((module, x, tag), {})))
    _restart()
    traces = ppcompile.counters.backend_compiles
    loaded = _load(data)
    with torch.inference_mode():
        for n in (6, 4, 9):
            torch.testing.assert_close(loaded(module, x[:n], tag), _tagged_call(module, x[:n], tag))
    assert ppcompile.counters.backend_compiles == traces

"""stored_stage: a lowered stage written to bytes and read back serves every token count as eager does,
keeps its split module's code and its segments, and only graph modules' code is stored."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from stage_helpers import check

import ppcompile
from ppcompile.backends.pp_breakable import compile_stage, serve_stage
from ppcompile.backends.stored_stage import StoredStageError, dumps_compiled_stage, loads_compiled_stage
from ppcompile.config import PPBreakableConfig
from ppcompile.models import ModelConfig, make_stage
from ppcompile.runtime.compiled_stage import CompiledStage

CFG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1,
                  head_dim=8, num_layers=4)
CONFIG = PPBreakableConfig.from_options({"graph_mode": "emulate", "capture_sizes": [4, 8]})


def _restoring_backend(compiled: list[CompiledStage], restored: list[CompiledStage]) -> Any:
    """A backend that lowers each stage graph, stores it and serves what it reads back."""
    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        stage = compile_stage(gm, example_inputs, CONFIG)
        back = loads_compiled_stage(dumps_compiled_stage(stage))
        compiled.append(stage)
        restored.append(back)
        return serve_stage(back, CONFIG, example_inputs)

    return backend


def test_a_stage_read_back_serves_every_token_count_as_eager() -> None:
    stage = make_stage(CFG, 1, 2)
    compiled: list[CompiledStage] = []
    restored: list[CompiledStage] = []
    fn = torch.compile(stage, backend=_restoring_backend(compiled, restored))
    for n in (5, 1, 4, 8, 9, 17):  # traced, one token, a bucket, the cap, cap + 1 and above (eager)
        check(stage, fn, CFG, 1, 2, n)
    symbolic = next(i for i, s in enumerate(compiled) if s.token_symbol is not None)
    before, after = compiled[symbolic], restored[symbolic]
    assert after.segments == before.segments and after.plan.sizes == before.plan.sizes
    assert (after.layer_ids, after.token_symbol) == (before.layer_ids, before.token_symbol)
    assert repr(after.input_specs) == repr(before.input_specs)  # size functions compare by expression
    assert after.record.split_module is not None and before.record.split_module is not None
    assert after.record.split_module.code == before.record.split_module.code
    assert after.record.compile_id is None and before.record.compile_id is not None
    assert ppcompile.runtimes_of(stage)[-1].compiled is after


def test_reading_back_compiles_each_graph_modules_code_once(monkeypatch: pytest.MonkeyPatch) -> None:
    stage = make_stage(CFG, 1, 2)
    compiled: list[CompiledStage] = []
    check(stage, torch.compile(stage, backend=_restoring_backend(compiled, [])), CFG, 1, 2, 5)
    data = dumps_compiled_stage(compiled[0])
    compiles: list[int] = []
    recompile = torch.fx.GraphModule.recompile

    def counted(gm: torch.fx.GraphModule) -> Any:
        compiles.append(id(gm))
        return recompile(gm)

    monkeypatch.setattr(torch.fx.GraphModule, "recompile", counted)
    back = loads_compiled_stage(data)
    split = back.record.split_module
    assert split is not None
    children = [m for m in split.children() if isinstance(m, torch.fx.GraphModule)]
    assert len(children) == len(back.segments)
    assert sorted(compiles) == sorted({*compiles})  # none twice (a parent used to compile its children again)
    assert {id(m) for m in (split, *children)} <= {*compiles}
    monkeypatch.undo()
    check(stage, torch.compile(stage, backend=_serving(back)), CFG, 1, 2, 5)
    assert ppcompile.runtimes_of(stage)[-1].compiled is back


def _serving(stage: CompiledStage) -> Any:
    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        return serve_stage(stage, CONFIG, example_inputs)

    return backend


def test_a_segment_run_by_other_code_is_not_stored() -> None:
    stage = make_stage(CFG, 1, 2)
    compiled: list[CompiledStage] = []
    check(stage, torch.compile(stage, backend=_restoring_backend(compiled, [])), CFG, 1, 2, 5)
    lowered = compiled[0]
    step = lowered.program.steps[0]
    steps = (dataclasses.replace(step, fn=lambda *args: args), *lowered.program.steps[1:])
    other = dataclasses.replace(lowered, program=dataclasses.replace(lowered.program, steps=steps))
    with pytest.raises(StoredStageError, match=f"segment {step.segment.name} runs"):
        dumps_compiled_stage(other)


@pytest.mark.parametrize("data", [b"", b"not a pickle", dumps_compiled_stage.__name__.encode()])
def test_bytes_that_hold_no_stored_stage_are_refused(data: bytes) -> None:
    with pytest.raises(StoredStageError):
        loads_compiled_stage(data)


def test_a_pickle_of_something_else_is_refused() -> None:
    import pickle

    with pytest.raises(StoredStageError, match="not a stored stage"):
        loads_compiled_stage(pickle.dumps(("another-format", 1)))

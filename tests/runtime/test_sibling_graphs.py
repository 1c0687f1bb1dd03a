"""A static stage graph's calls (a 1-token call's: Dynamo makes a size of 1 a constant, even on a marked
dim) are served by the symbolic stage graph of the same module, from its buckets."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ppcompile
from ppcompile.models import (
    REFERENCE_CONFIGS,
    make_batch,
    make_forward_context,
    make_stage,
    set_forward_context,
)
from ppcompile.runtime.sibling_graphs import plan_static_calls

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

CFG = REFERENCE_CONFIGS["tiny"]
OPTIONS = {"graph_mode": "emulate", "capture_sizes": [1, 2, 4, 8, 16]}


def _run(module: torch.nn.Module, stage: torch.nn.Module, n: int, seed: int, mark: bool = False) -> dict:
    ids, pos, proxies = make_batch(CFG, [n], 1, 4, seed=seed)
    if mark:
        ppcompile.mark_token_dynamic(ids, pos, proxies)
    ctx = make_forward_context([n], CFG, range(stage.start_layer, stage.end_layer))
    with torch.inference_mode(), set_forward_context(ctx):
        return {k: v.clone() for k, v in module(ids, pos, pp_proxy_tensors=proxies).items()}


def _check(compiled: torch.nn.Module, stage: torch.nn.Module, n: int, seed: int, mark: bool = False) -> None:
    got, want = _run(compiled, stage, n, seed, mark), _run(stage, stage, n, seed)
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=lambda m, k=k: f"{k}, {n} tokens: {m}")


def test_a_first_call_of_one_token_is_served_by_the_symbolic_graph_once_there_is_one() -> None:
    stage = make_stage(CFG, 1, 4)
    compiled = torch.compile(stage, backend="pp_breakable", options=OPTIONS)
    with ppcompile.counters.expect(eager_runs=1, replays=0):
        _check(compiled, stage, 1, seed=0, mark=True)  # a static graph; no symbolic one yet
    with ppcompile.counters.expect(replays=1, eager_runs=0, backend_compiles=1):
        _check(compiled, stage, 5, seed=1)  # the recompile: a symbolic token count
    with ppcompile.counters.expect(replays=2, eager_runs=0, backend_compiles=0, replays_by_bucket={1: 2}):
        _check(compiled, stage, 1, seed=2)
        _check(compiled, stage, 1, seed=3)
    static, symbolic = ppcompile.runtimes_of(stage)
    assert static.token_symbol is None and static.served_by is not None
    assert f"served by {symbolic.name}'s buckets" in static.describe()


def test_a_one_token_call_after_a_marked_first_call_replays() -> None:
    stage = make_stage(CFG, 1, 4)
    compiled = torch.compile(stage, backend="pp_breakable", options=OPTIONS)
    _check(compiled, stage, 6, seed=0, mark=True)
    with ppcompile.counters.expect(replays=2, eager_runs=0, backend_compiles=1, replays_by_bucket={1: 2}):
        _check(compiled, stage, 1, seed=1)  # Dynamo's static 1-token graph, then served by the first
        _check(compiled, stage, 1, seed=2)


def test_no_plan_when_the_symbolic_graph_takes_an_input_the_static_one_does_not() -> None:
    stage = make_stage(CFG, 1, 4)
    compiled = torch.compile(stage, backend="pp_breakable", options=OPTIONS)
    _check(compiled, stage, 1, seed=0, mark=True)
    _check(compiled, stage, 5, seed=1)
    static, symbolic = (rt.compiled for rt in ppcompile.runtimes_of(stage))
    assert plan_static_calls(static, symbolic) is not None
    renamed = dataclasses.replace(symbolic, input_names=tuple(f"other_{n}" for n in symbolic.input_names))
    assert plan_static_calls(static, renamed) is None
    fewer_outputs = dataclasses.replace(
        symbolic, program=dataclasses.replace(symbolic.program, outputs=symbolic.program.outputs[:-1]))
    assert plan_static_calls(static, fewer_outputs) is None
    assert plan_static_calls(symbolic, static) is None  # only a static graph is served by a symbolic one

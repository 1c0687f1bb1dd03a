"""The backend's registry of stage runtimes: ``ppcompile.runtimes_of(module)`` finds the runtimes serving
one module (recompiles included), never another instance's."""

from __future__ import annotations

import gc
import inspect
from typing import Any

import pytest
import torch
from tiny_stage import H, Tiny, call

import ppcompile

OPTIONS = {"graph_mode": "emulate", "capture_sizes": [4, 8, 16]}


def test_runtimes_of_finds_a_modules_runtimes_recompiles_included_oldest_first() -> None:
    first, second = Tiny(), Tiny()
    c1 = torch.compile(first, backend="pp_breakable", options=OPTIONS)
    call(c1, 5)
    call(c1, 1)  # a 1-token call: Dynamo traces a static graph, a second runtime of the module
    mine = ppcompile.runtimes_of(c1)
    assert [rt.token_symbol is not None for rt in mine] == [True, False]  # oldest first
    assert ppcompile.runtimes_of(first) == mine
    assert ppcompile.runtimes_of(second) == []  # not served yet
    # Dynamo serves a second instance of the class with the same stage graph (its parameters are graph
    # inputs): the runtime keeps an instance per module, and is found from both.
    call(torch.compile(second, backend="pp_breakable", options=OPTIONS), 6)
    (shared,) = ppcompile.runtimes_of(second)
    assert shared is mine[0] and len(shared.instances()) == 2
    assert ppcompile.runtimes_of(torch.nn.Linear(H, H)) == []


def test_an_always_eager_graph_describes_its_segments_as_run_eagerly() -> None:
    c = torch.compile(Tiny(), backend="pp_breakable", options=OPTIONS)
    call(c, 1)
    (rt,) = ppcompile.runtimes_of(c)
    assert rt.eager_reason is not None
    assert "graph segment, run eagerly (always eager)" in rt.describe()


def test_runtimes_of_a_reset_dynamo_are_dropped_even_while_referenced() -> None:
    c = torch.compile(Tiny(), backend="pp_breakable", options=OPTIONS)
    call(c, 5)
    (kept,) = ppcompile.runtimes_of(c)
    assert kept in ppcompile.stage_runtimes()
    torch._dynamo.reset()
    assert kept not in ppcompile.stage_runtimes() and ppcompile.runtimes_of(c) == []
    call(c, 6)  # Dynamo compiles the module again: a new runtime, listed
    (fresh,) = ppcompile.runtimes_of(c)
    assert fresh is not kept and ppcompile.stage_runtimes() == [fresh]


class Scaled(Tiny):
    """Tiny times a per-instance int attribute: Dynamo guards on it, so each instance recompiles."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.k


def test_names_tell_another_module_instance_from_a_recompile() -> None:
    first, second = Scaled(2), Scaled(3)
    c1, c2 = (torch.compile(m, backend="pp_breakable", options=OPTIONS) for m in (first, second))
    call(c1, 5)
    call(c2, 6)  # its int attribute fails the guards: compile 2 of the frame, for another module
    call(c1, 1)  # a 1-token call: a static graph, compile 3 of the frame, a recompile for the first
    (a, one_token), (b,) = ppcompile.runtimes_of(first), ppcompile.runtimes_of(second)
    records = [rt.compiled.record for rt in (a, b, one_token)]
    assert [(r.frame_compile, r.module, r.recompile_of) for r in records] == [
        (1, 1, None), (2, 2, None), (3, 1, a.name)]
    assert (a.label, b.label) == (a.name, f"{b.name} (module 2 of its frame)")
    assert one_token.label == f"{one_token.name} (recompile of {a.name})"
    assert one_token.describe().startswith(one_token.label)


class PadsToFour(Tiny):
    """Pads the tokens to a multiple of 4 only when needed: the ``if`` makes Dynamo guard on the count's
    residue, so multiples of 4 get a stage graph of their own whatever the marking."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = (4 - x.shape[0] % 4) % 4
        if pad:  # the guarding line
            x = torch.nn.functional.pad(x, (0, 0, 0, pad))
        return super().forward(x)[: x.shape[0] - pad]


def test_a_recompile_names_the_guard_that_failed_and_its_source_line() -> None:
    m = PadsToFour()
    c = torch.compile(m, backend="pp_breakable", options=OPTIONS)
    for n in (5, 6, 8, 12):
        call(c, n)
    first, second = ppcompile.runtimes_of(m)
    assert first.compiled.record.recompile_reason is None
    reason = second.compiled.record.recompile_reason
    line = inspect.getsourcelines(PadsToFour.forward)[1] + 2
    assert reason is not None and reason.startswith(first.name.removeprefix("stage_graph_").replace("_", "/"))
    assert f"test_pp_breakable.py:{line} in forward" in reason and "if pad:" in reason, reason
    described = second.describe()
    assert "recompiled: these guards failed" in described and reason.splitlines()[0] in described


def test_the_backend_compiles_with_the_cycle_collector_paused() -> None:
    from ppcompile.backends.pp_breakable import compile_stage, serve_stage
    from ppcompile.config import PPBreakableConfig

    started: list[int] = []
    during_compile: list[int] = []

    def on_collection(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(info["generation"])

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        config = PPBreakableConfig.from_options(OPTIONS)
        before = len(started)
        stage = compile_stage(gm, example_inputs, config)
        during_compile.append(len(started) - before)
        return serve_stage(stage, config, [*example_inputs, *stage.bound_inputs])

    thresholds = gc.get_threshold()
    gc.callbacks.append(on_collection)
    gc.set_threshold(50)  # a young collection every 50 allocations, were the collector on
    try:
        call(torch.compile(Tiny(), backend=backend), 5)
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(on_collection)
    assert during_compile[0] <= 1  # the one that catches up as the collector resumes
    assert started  # the collector ran outside the compile
    assert gc.isenabled()


def test_the_collector_is_left_as_it_was() -> None:
    from ppcompile.backends.pp_breakable import collector_paused

    with pytest.raises(ValueError), collector_paused():
        assert not gc.isenabled()
        raise ValueError
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()

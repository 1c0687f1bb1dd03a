"""Runtimes built from a changed plan, for tests that show a plan fact or a runtime step matters (a
runtime without the refresh, without the traced layout, without the aliased-input copy) without
patching production code: compile once recording the calls, then take the ``CompiledStage``, change its
program with ``dataclasses.replace`` and serve the recorded call with a new ``StageRuntime``, or serve
it with an instance's bound graph path alone."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ppcompile.backends.pp_breakable import pp_breakable
from ppcompile.runtime.program import Program
from ppcompile.runtime.stage_runtime import StageRuntime


class RecordedStage:
    """The runtimes a compile built and the arguments of the last call each served."""

    def __init__(self) -> None:
        self.runtimes: list[StageRuntime] = []
        self._args: dict[int, tuple[Any, ...]] = {}

    def backend(self, options: dict[str, Any]) -> Callable[..., Any]:
        def compile_stage(gm: torch.fx.GraphModule, example_inputs: list[Any], **_: Any) -> Any:
            runtime = pp_breakable(gm, example_inputs, options=options)
            self.runtimes.append(runtime)

            def call(*args: Any) -> tuple[Any, ...]:
                self._args[id(runtime)] = _copied(args, runtime)
                return runtime(*args)

            return call

        return compile_stage

    @property
    def runtime(self) -> StageRuntime:
        """The newest runtime of a symbolic stage graph."""
        return [rt for rt in self.runtimes if rt.token_symbol is not None][-1]

    def args(self, runtime: StageRuntime | None = None) -> tuple[Any, ...]:
        """Fresh copies of the live tensors of ``runtime``'s last call (module state as is)."""
        runtime = runtime or self.runtime
        return _copied(self._args[id(runtime)], runtime)


def _copied(args: tuple[Any, ...], runtime: StageRuntime) -> tuple[Any, ...]:
    live = set(runtime.compiled.tensor_slots)
    return tuple(a.clone() if i in live else a for i, a in enumerate(args))


def compile_recorded(module: torch.nn.Module, options: dict[str, Any],
                     **compile_kwargs: Any) -> tuple[Any, RecordedStage]:
    """``torch.compile(module, **compile_kwargs)`` with the ``pp_breakable`` backend and ``options``,
    recording its calls."""
    recorded = RecordedStage()
    return torch.compile(module, backend=recorded.backend(options), **compile_kwargs), recorded


def graph_path_call(runtime: StageRuntime, args: tuple[Any, ...], n: int) -> tuple[Any, ...]:
    """``args`` (a recorded call's, ``n`` live tokens) served by the bound graph path of ``runtime``'s
    first instance alone: no input check, no aliased-input copy, no output copies (what the runtime adds
    around it)."""
    compiled = runtime.compiled
    assert compiled.token_symbol is not None
    b = runtime.plan.bucket(n)
    assert b is not None, f"{n} tokens take no bucket"
    env_n = {e: int(args[i]) for i, e in compiled.symbol_slots}
    env_n[compiled.token_symbol] = n
    return runtime.instances()[0].forward(args, env_n, n, b)


def with_program(runtime: StageRuntime, program: Program) -> StageRuntime:
    """A new runtime of ``runtime``'s compiled stage and config, serving ``program`` instead."""
    return StageRuntime(dataclasses.replace(runtime.compiled, program=program), runtime.config)


def map_steps(program: Program, change: Callable[[Any], Any]) -> Program:
    """``program`` with each step replaced by ``change(step)``."""
    return dataclasses.replace(program, steps=tuple(change(st) for st in program.steps))

"""The per-call paths of a stage as straight-line Python, generated once per stage: the live path here,
the graph path in ``graph_codegen.py`` (which shares this module's pieces).

A ``StageRuntime`` call walks the program's steps: on the *live path* (``graph_mode="none"``, above the
capture cap, autograd on, a stage that cannot be graphed) every segment runs at the live size; on the
*graph path* graph segments replay their bucket's graph between copy-ins, live-size views and eager
breaks. Walking the steps in a loop costs 2-5 us per step (argument lists, slot tables, output
unpacking, size evaluation); these modules generate, once per stage, functions that make the same
calls with locals, the way FX's own codegen does (:func:`make_live_forward`,
``graph_codegen.make_graph_forward``). Each distinct size expression is evaluated once per call, not per use.

Program (three steps, a size argument ``s0``; inputs 0 and 1 are live tensors, 2 a weight)::

    step 0  graph  submod_0(slot 0, slot 1, size s0)  -> slots 3, 4
    step 1  break  submod_1(slot 3)                    -> slot 5
    step 2  graph  submod_2(slot 5, slot 4, slot 2)    -> slot 6
    outputs: slot 6, size s0

Generated, for Inductor segments (the tensors they read that no guard or compiled segment vouches for
are checked against their traced layout ``L[k]``; see :class:`LiveLayouts`)::

    def live_forward(args, env):
        v0, v1, v2 = args
        z0 = size_z0(env)
        L = layouts(env)
        step = -1
        try:
            if not isinstance(v0, Tensor) or (v0.shape, v0.stride(), v0.dtype, v0.device) != L[0]:
                v0 = layouts.repair(0, v0, L[0])
            if not isinstance(v1, Tensor) or (v1.shape, v1.stride(), v1.dtype, v1.device) != L[1]:
                v1 = layouts.repair(1, v1, L[1])
            step = 0
            v3, v4 = call_0(v0, v1, z0)
            step = 1
            v5 = call_1(v3)
            if not isinstance(v5, Tensor) or (v5.shape, v5.stride(), v5.dtype, v5.device) != L[2]:
                v5 = layouts.repair(2, v5, L[2])
            step = 2
            v6 = call_2(v5, v4, v2)
        except BaseException as e:
            raised(e, step)
            raise
        return (v6, z0)

``raised`` adds a note naming the segment to the exception in flight (its type is unchanged).
The function holds the program's callables, never the runtime (no reference cycle).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy
import torch

from ppcompile.errors import add_note
from ppcompile.runtime.layout_checks import CheckedValue, LiveLayouts
from ppcompile.runtime.program import Program, Ref, Step
from ppcompile.symbolic import SizeFn

__all__ = ["LiveForward", "live_forward_source", "make_live_forward"]

LiveForward = Callable[[Sequence[Any], Mapping[sympy.Symbol, int]], tuple[Any, ...]]


# ----------------------------------------------------------------------------------- shared pieces
class _Sizes:
    """Locals holding the value of each distinct size expression for one env (``env_n`` or ``env_b``)."""

    def __init__(self, prefix: str, env: str, names: dict[str, Any]) -> None:
        self.prefix, self.env, self.names = prefix, env, names
        self.locals: dict[sympy.Expr, str] = {}

    def __call__(self, size: SizeFn) -> str:
        local = self.locals.get(size.expr)
        if local is None:
            local = self.locals[size.expr] = f"{self.prefix}{len(self.locals)}"
            self.names[f"size_{local}"] = size
        return local

    def prologue(self) -> list[str]:
        return [f"    {local} = size_{local}({self.env})" for local in self.locals.values()]


def _call_segment(step: Step, args: str, names: dict[str, Any]) -> str:
    """The line calling ``step``'s segment and binding the outputs someone reads to ``v<slot>``."""
    call = f"call_{step.index}"
    single = step.single_output and step.call is not None
    names[call] = step.call if single else step.fn
    if single:
        return f"{f'v{step.out_slots[0]}' if step.writes else '_'} = {call}({args})"
    if not step.writes:
        return f"{call}({args})"
    # Unpacked by position: the callable returns exactly one value per output.
    targets = ", ".join(f"v{s}" if s >= 0 else "_" for s in step.out_slots)
    return f"{targets}{',' if len(step.out_slots) == 1 else ''} = {call}({args})"


def _function(
    header: str, num_inputs: int, prologue: list[str], body: list[str], raised: str, outputs: list[str]
) -> str:
    """A generated function: unpack the inputs, evaluate sizes, run ``body`` under a handler that
    annotates the exception (``step``: the step that raised, -1 before the first), return ``outputs``."""
    lines = [header]
    if num_inputs:
        unpack = ", ".join(f"v{i}" for i in range(num_inputs))
        lines.append(f"    {unpack}{',' if num_inputs == 1 else ''} = args")
    lines += prologue
    lines += ["    step = -1", "    try:"]
    lines += [f"        {line}" for line in body or ["pass"]]
    lines += ["    except BaseException as e:", f"        {raised}", "        raise",
              f"    return ({', '.join(outputs)}{',' if len(outputs) == 1 else ''})"]
    return "\n".join(lines) + "\n"


def _outputs(program: Program, sizes: _Sizes, names: dict[str, Any]) -> list[str]:
    outputs = []
    for i, r in enumerate(program.outputs):
        if isinstance(r, Ref):
            outputs.append(sizes(r.size) if r.size is not None else f"v{r.slot}")
        else:
            names[f"const_{i}"] = r
            outputs.append(f"const_{i}")
    return outputs


def _exec(name: str, stage: str, source: str, names: dict[str, Any], raised: Callable[..., None]) -> Any:
    scope: dict[str, Any] = {**names, "raised": raised}
    exec(compile(source, f"<ppcompile {name} {stage}>", "exec"), scope)
    fn = scope[name]
    fn.source = source
    return fn


# ----------------------------------------------------------------------------------- live path
def live_forward_source(
    program: Program, layouts: LiveLayouts | None = None
) -> tuple[str, dict[str, Any]]:
    """The generated source of ``program``'s live forward and the globals it reads; with ``layouts``,
    the values it lists are checked (``L``: their expected layouts for this call)."""
    names: dict[str, Any] = {}
    sizes = _Sizes("z", "env", names)
    checks: dict[int, int] = {}  # slot -> index in layouts.checked
    if layouts is not None:
        checks = {c.slot: k for k, c in enumerate(layouts.checked)}
        names["layouts"] = layouts
        names["Tensor"] = torch.Tensor

    def check(slot: int) -> list[str]:
        k = checks.get(slot)
        if k is None:
            return []
        v = f"v{slot}"
        layout = f"({v}.shape, {v}.stride(), {v}.dtype, {v}.device)"
        return [f"if not isinstance({v}, Tensor) or {layout} != L[{k}]:",
                f"    {v} = layouts.repair({k}, {v}, L[{k}])"]

    body = [line for slot in range(program.num_inputs) for line in check(slot)]
    for step in program.steps:
        args = ", ".join(sizes(r.size) if r.size is not None else f"v{r.slot}" for r in step.args)
        body += [f"step = {step.index}", _call_segment(step, args, names)]
        for _, s in step.writes:
            body += check(s)
    outputs = _outputs(program, sizes, names)
    prologue = sizes.prologue() + (["    L = layouts(env)"] if checks else [])
    source = _function("def live_forward(args, env):", program.num_inputs, prologue, body,
                       "raised(e, step)", outputs)
    return source, names


def _annotate(stage: str, segments: Sequence[str], e: BaseException, step: int) -> None:
    """Adds a note naming the failed segment to the exception in flight (its type is unchanged)."""
    where = f"segment {segments[step]}" if step >= 0 else "setup"
    add_note(e, f"pp_breakable: raised in {where} of {stage}, run eagerly")


def make_live_forward(
    program: Program, stage: str = "stage", checked: Sequence[CheckedValue] = ()
) -> LiveForward:
    """Compiles ``program``'s live forward. ``checked``: values to check before graph segments read
    them (:class:`LiveLayouts`, for segments compiled without Inductor's input asserts). A failure gets
    a note naming the segment ("setup" before the first)."""
    source, names = live_forward_source(program, LiveLayouts(stage, checked) if checked else None)
    segments = tuple(st.segment.name for st in program.steps)
    fn: LiveForward = _exec("live_forward", stage, source, names,
                            functools.partial(_annotate, stage, segments))
    return fn

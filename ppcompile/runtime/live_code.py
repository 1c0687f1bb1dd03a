"""The live path of a stage as straight-line Python: every segment at the live token count.

``StageRuntime`` runs a stage at its live size (no buffers, no graphs) for ``graph_mode="none"``, above
the capture cap, with autograd on and when a stage cannot be graphed. Walking the program's steps in a
loop costs about 2 us per step (argument lists, slot tables, output unpacking); this module generates,
once per stage, a function that makes the same calls with locals, the way FX's own codegen does. Each
distinct size argument is evaluated once per call, not once per use.

Program (three steps, a size argument ``s0``; inputs 0 and 1 are live tensors, 2 a weight)::

    step 0  graph  submod_0(slot 0, slot 1, size s0)  -> slots 3, 4
    step 1  break  submod_1(slot 3)                    -> slot 5
    step 2  graph  submod_2(slot 5, slot 4, slot 2)    -> slot 6
    outputs: slot 6, size s0

Generated, for Inductor segments (the tensors they read that no guard or compiled segment vouches for
are checked against their traced layout ``L[k]``; see :class:`LiveLayouts`)::

    def live_forward(args, env):
        v0, v1, v2 = args
        z0 = size_0(env)
        L = layouts(env)
        step = -1
        try:
            if (v0.shape, v0.stride()) != L[0]:
                v0 = layouts.repair(0, v0, L[0])
            if (v1.shape, v1.stride()) != L[1]:
                v1 = layouts.repair(1, v1, L[1])
            step = 0
            v3, v4 = call_0(v0, v1, z0)
            step = 1
            v5 = call_1(v3)
            if (v5.shape, v5.stride()) != L[2]:
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

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import sympy
import torch

from ppcompile.runtime.program import Program, Ref
from ppcompile.runtime.validation import GUARD_HINT, InputMismatchError
from ppcompile.symbolic import SizeFn

__all__ = ["CheckedValue", "LayoutMismatchError", "LiveForward", "LiveLayouts", "checked_values",
           "live_forward_source", "make_live_forward"]

log = logging.getLogger(__name__)

LiveForward = Callable[[Sequence[Any], Mapping[sympy.Symbol, int]], tuple[Any, ...]]
Layout = tuple[tuple[int, ...], tuple[int, ...]]


class LayoutMismatchError(RuntimeError):
    """A break segment returned a tensor whose shape differs from the one traced for it."""


@dataclasses.dataclass(frozen=True)
class CheckedValue:
    """A tensor that graph segments read at the live size: a stage input or a break output."""

    slot: int
    what: str  # for messages: "input 'x'" or "break segment submod_1 (output 0)"
    is_input: bool
    sizes: tuple[SizeFn, ...]
    strides: tuple[SizeFn, ...]


class LiveLayouts:
    """Checks the tensors that Inductor segments read on the live path against their traced layout.

    Segments are compiled without Inductor's per-input size asserts (``segment_compilers``): their
    parameters are guarded by Dynamo, their intermediates come from other compiled segments, and the
    rest (stage inputs and break outputs) is checked here, once per value per call instead of once per
    reading segment. A stride that differs is copied into the traced layout; a shape that differs raises
    (``InputMismatchError`` for an input, which only happens when Dynamo's guards were dropped;
    :class:`LayoutMismatchError` for a break op whose fake implementation promised another shape).
    """

    def __init__(self, stage: str, checked: Sequence[CheckedValue]) -> None:
        self.stage = stage
        self.checked = list(checked)
        self._memo: dict[tuple[int, ...], tuple[Layout, ...]] = {}
        self._warned: set[int] = set()

    def __call__(self, env: Mapping[sympy.Symbol, int]) -> tuple[Layout, ...]:
        """The expected layout of each checked value for ``env`` (memoised by the env's values)."""
        key = tuple(env.values())
        hit = self._memo.get(key)
        if hit is None:
            hit = tuple((tuple(f(env) for f in c.sizes), tuple(f(env) for f in c.strides))
                        for c in self.checked)
            if len(self._memo) < 4096:
                self._memo[key] = hit
        return hit

    def repair(self, i: int, value: Any, expected: Layout) -> torch.Tensor:
        """``value`` in the expected layout, or a clear error when its shape is not the traced one."""
        c = self.checked[i]
        shape, stride = expected
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
            got = f"shape {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            if c.is_input:
                raise InputMismatchError(
                    f"pp_breakable: {c.what} of {self.stage}: expected shape {list(shape)}, got {got}. "
                    f"{GUARD_HINT}")
            raise LayoutMismatchError(
                f"pp_breakable: {c.what} of {self.stage} returned {got}, but its trace (the op's fake "
                f"implementation) has shape {list(shape)}, which the compiled segment after it reads. "
                "Fix the op's fake implementation (torch.library.opcheck tests it)")
        if all(s == e or n < 2 for s, e, n in zip(value.stride(), stride, shape)):
            return value  # only strides of size-1 dims differ: they address no other element
        if i not in self._warned:
            self._warned.add(i)
            log.log(logging.INFO if c.is_input else logging.WARNING,
                    "%s: %s has strides %s where the trace has %s; it is copied into the traced layout "
                    "before compiled segments read it%s", self.stage, c.what, value.stride(), stride,
                    "" if c.is_input else " (fix the op's fake implementation to avoid the copy)")
        fixed = torch.empty_strided(shape, stride, dtype=value.dtype, device=value.device)
        fixed.copy_(value)
        return fixed


def checked_values(program: Program, input_slots: Iterable[int]) -> list[CheckedValue]:
    """The tensors a graph step reads at the live size that need a check: the given stage inputs and
    every break output."""
    graph_reads = {r.slot for st in program.steps if st.segment.is_graph for r in st.args if r.size is None}
    checked: list[CheckedValue] = []
    for slot in sorted(set(input_slots) & graph_reads):
        layout = program.input_layouts.get(slot)
        if layout is not None:
            name, sizes, strides = layout
            checked.append(CheckedValue(slot, f"input {name!r}", True, sizes, strides))
    for st in program.steps:
        if st.segment.is_graph:
            continue
        for i, slot in st.writes:
            out_sizes = st.out_sizes[i] if i < len(st.out_sizes) else None
            out_strides = st.out_strides[i] if i < len(st.out_strides) else None
            if slot in graph_reads and isinstance(out_sizes, tuple) and out_strides is not None:
                checked.append(CheckedValue(slot, f"break segment {st.segment.name} (output {i})", False,
                                            out_sizes, out_strides))
    return checked


def live_forward_source(
    program: Program, layouts: LiveLayouts | None = None
) -> tuple[str, dict[str, Any]]:
    """The generated source of ``program``'s live forward and the globals it reads; with ``layouts``,
    the values it lists are checked (``L``: their expected layouts for this call)."""
    names: dict[str, Any] = {}
    sizes: dict[sympy.Expr, str] = {}  # size expression -> local holding its value
    checks: dict[int, int] = {}  # slot -> index in layouts.checked
    if layouts is not None:
        checks = {c.slot: k for k, c in enumerate(layouts.checked)}
        names["layouts"] = layouts

    def check(slot: int, indent: str) -> list[str]:
        k = checks.get(slot)
        if k is None:
            return []
        return [f"{indent}if (v{slot}.shape, v{slot}.stride()) != L[{k}]:",
                f"{indent}    v{slot} = layouts.repair({k}, v{slot}, L[{k}])"]

    def size_local(r: Ref) -> str:
        assert r.size is not None
        local = sizes.get(r.size.expr)
        if local is None:
            local = sizes[r.size.expr] = f"z{len(sizes)}"
            names[f"size_{local[1:]}"] = r.size
        return local

    def arg(r: Ref) -> str:
        return size_local(r) if r.size is not None else f"v{r.slot}"

    body: list[str] = []
    for step in program.steps:
        call = f"call_{step.index}"
        single = step.single_output and step.call is not None
        names[call] = step.call if single else step.fn
        args = ", ".join(arg(r) for r in step.args)
        body.append(f"step = {step.index}")
        if single:
            target = f"v{step.out_slots[0]}" if step.writes else "_"
            body.append(f"{target} = {call}({args})")
        elif step.writes:  # unpacked by position: the callable returns exactly one value per output
            targets = ", ".join(f"v{s}" if s >= 0 else "_" for s in step.out_slots)
            body.append(f"{targets}{',' if len(step.out_slots) == 1 else ''} = {call}({args})")
        else:
            body.append(f"{call}({args})")
        for _, s in step.writes:
            body += check(s, "")
    outputs = []
    for i, r in enumerate(program.outputs):
        if isinstance(r, Ref):
            outputs.append(arg(r))
        else:
            names[f"const_{i}"] = r
            outputs.append(f"const_{i}")
    inputs = "".join(f"v{i}, " for i in range(program.num_inputs))
    lines = ["def live_forward(args, env):"]
    if program.num_inputs:
        lines.append(f"    {inputs.rstrip(', ')}{',' if program.num_inputs == 1 else ''} = args")
    lines += [f"    {local} = size_{local[1:]}(env)" for local in sizes.values()]
    if checks:
        lines.append("    L = layouts(env)")
    lines += ["    step = -1", "    try:"]
    for slot in range(program.num_inputs):
        lines += check(slot, "        ")
    lines += [f"        {line}" for line in body]
    lines += ["    except BaseException as e:", "        raised(e, step)", "        raise",
              f"    return ({', '.join(outputs)}{',' if len(outputs) == 1 else ''})"]
    return "\n".join(lines) + "\n", names


def _annotate(stage: str, segments: Sequence[str], e: BaseException, step: int) -> None:
    """Adds a note naming the failed segment to the exception in flight (its type is unchanged)."""
    where = f"segment {segments[step]}" if step >= 0 else "setup"
    add_note = getattr(e, "add_note", None)  # Python >= 3.11
    if add_note is not None:
        add_note(f"pp_breakable: raised in {where} of {stage}, run eagerly")


def make_live_forward(
    program: Program, stage: str = "stage", checked: Sequence[CheckedValue] = ()
) -> LiveForward:
    """Compiles ``program``'s live forward. ``checked``: values to check before graph segments read
    them (:class:`LiveLayouts`, for segments compiled without Inductor's input asserts). A failure gets
    a note naming the segment ("setup" before the first)."""
    layouts = LiveLayouts(stage, checked) if checked else None
    source, names = live_forward_source(program, layouts)
    segments = tuple(st.segment.name for st in program.steps)
    scope: dict[str, Any] = {**names, "raised": functools.partial(_annotate, stage, segments)}
    exec(compile(source, f"<ppcompile live_forward {stage}>", "exec"), scope)
    fn: LiveForward = scope["live_forward"]
    fn.source = source  # type: ignore[attr-defined]
    return fn

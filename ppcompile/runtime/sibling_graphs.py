"""Two stage graphs of one module (Dynamo's compiles of one frame), related by their inputs.

**Inputs of another structure.** A recompile whose live inputs differ in structure from the module's
first symbolic stage graph's (an input gone or new, a dtype, device or rank changed) was most likely made
for a bad input: :func:`input_changes` lists the differences, by the inputs' Dynamo names.

**Static calls served by a symbolic graph.** Dynamo makes a size of 1 a constant, even on a dim marked
dynamic: a 1-token call gets a stage graph of its own with concrete sizes (as does the first call with
``dynamic=None``, or one whose token count equals another dim of the inputs), and Dynamo keeps sending
calls of that exact size to it. Such a graph has no token count to pad, so it ran every call eagerly.
When the same frame and module also have a stage graph with a symbolic token count, the static graph's
calls are handed to it instead: its inputs are the same Dynamo sources (placeholders of the same names)
plus the token count, so each call is one argument shuffle and then that graph's bucket::

    static:   (l_input_ids_, l_positions_, l_self_..._weight, ...)           1 token, always eager
    symbolic: (s0, l_input_ids_, l_positions_, l_self_..._weight, ...)       bucket 1 replays

A pair is linked only when every input of the symbolic graph is an input of the static one or a size one of
them carries (its token count; another size the static graph made a constant, such as a request count of
1, read off the dim of a shared input that is exactly that size), and both return the same outputs (no
sizes among them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ppcompile.runtime.compiled_stage import CompiledStage
from ppcompile.runtime.validation import InputSpec

__all__ = ["StaticCallPlan", "StaticCalls", "input_changes", "plan_static_calls"]


def input_changes(before: CompiledStage, after: CompiledStage) -> tuple[str, ...]:
    """How ``after``'s inputs differ in structure from ``before``'s, one line each (``input 'l_x_':
    float32 on cpu, 2-d -> float64 on cpu, 2-d``): live tensor inputs gone or new (by placeholder name;
    module state, sizes and scalars aside), and the dtype, device or rank of inputs both copy into static
    buffers. Sizes are not structure. A graph with concrete sizes (no token count) is not
    compared: Dynamo specialises inputs away there."""
    if before.token_symbol is None or after.token_symbol is None:
        return ()
    old, new = _tensor_names(before), _tensor_names(after)
    changes = [f"input {name!r}: gone" for name in old if name not in new]
    changes += [f"input {name!r}: new" for name in new if name not in old]
    old_specs = {s.name: s for s in before.input_specs}
    for spec in after.input_specs:
        was = old_specs.get(spec.name)
        if was is not None and (was.dtype, was.device, was.ndim) != (spec.dtype, spec.device, spec.ndim):
            changes.append(f"input {spec.name!r}: {_layout(was)} -> {_layout(spec)}")
    return tuple(sorted(changes))


def _tensor_names(stage: CompiledStage) -> dict[str, None]:
    """The names of ``stage``'s live tensor inputs (what a call passes: not module state, sizes or
    scalars), in order."""
    names = stage.input_names
    return {names[i]: None for i in stage.tensor_slots if i < len(names)}


def _layout(spec: InputSpec) -> str:
    return f"{str(spec.dtype).removeprefix('torch.')} on {spec.device}, {spec.ndim}-d"


class StaticCallPlan:
    """How a static stage graph's arguments become a symbolic sibling's: ``plan(args)`` -> its args."""

    __slots__ = ("_sources",)

    def __init__(self, sources: tuple[int | tuple[int, int], ...]) -> None:
        # Per sibling input: the static input it is, or (static input, dim) whose size is its value (the
        # token count, or another size the static graph made a constant: a request count of 1).
        self._sources = sources

    def __call__(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(args[s] if isinstance(s, int) else int(args[s[0]].shape[s[1]]) for s in self._sources)


class StaticCalls:
    """A static stage graph's calls, served by the symbolic stage graph named ``by``."""

    __slots__ = ("_plan", "_serve", "by")

    def __init__(self, by: str, serve: Callable[..., tuple[Any, ...]], plan: StaticCallPlan) -> None:
        self.by = by
        self._serve = serve
        self._plan = plan

    def __call__(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return self._serve(*self._plan(args))


def plan_static_calls(static: CompiledStage, symbolic: CompiledStage) -> StaticCallPlan | None:
    """The plan that serves ``static``'s calls by ``symbolic``, or None when their inputs or outputs do not
    correspond (module docstring)."""
    if static.token_symbol is not None or symbolic.token_symbol is None:
        return None
    if not static.input_names or not symbolic.input_names:
        return None
    outputs = symbolic.program.outputs
    if len(outputs) != len(static.program.outputs) or any(r.size is not None for r in outputs):
        return None
    raw_static = len(static.input_names) - len(static.bound_inputs)
    where = {name: i for i, name in enumerate(static.input_names[:raw_static])}
    symbols = dict(symbolic.symbol_slots)
    dims = _symbol_dims(symbolic, where)
    sources: list[int | tuple[int, int]] = []
    for i, name in enumerate(symbolic.input_names[:len(symbolic.input_names) - len(symbolic.bound_inputs)]):
        if name in where:
            sources.append(where[name])
        elif i in symbols and symbols[i] in dims:
            sources.append(dims[symbols[i]])
        else:
            return None  # a size no shared input carries, or an input the static graph does not take
    return StaticCallPlan(tuple(sources)) if symbolic.token_symbol in dims else None


def _symbol_dims(symbolic: CompiledStage, where: dict[str, int]) -> dict[Any, tuple[int, int]]:
    """Symbol -> (static input, dim) whose size is its value: the symbolic graph's token input first,
    then any dim of a shared tensor input that is exactly the symbol (``symbolic.program.input_layouts``)."""
    found: dict[Any, tuple[int, int]] = {}
    if symbolic.token_input is not None:
        slot, dim = symbolic.token_input
        i = where.get(symbolic.input_names[slot])
        if i is not None:
            found[symbolic.token_symbol] = (i, dim)
    for name, layout in symbolic.program.input_layouts.values():
        if name not in where:
            continue
        for d, size in enumerate(layout.sizes):
            if size.expr.is_Symbol:
                found.setdefault(size.expr, (where[name], d))
    return found

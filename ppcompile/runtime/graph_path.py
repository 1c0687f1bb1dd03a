"""A stage instance's graph path: the generated code (``graph_codegen.py``) bound per bucket to the
instance's slot table, one replay callable per graph step, its fused copiers and output ring, and its
instrumented variants.

The code a graph-path call runs depends on three facts fixed when an instance exists (whether its
executor binds inputs, whether replays are handed their arguments, whether it has fused copiers), so
the instance generates it once (:class:`GraphPath`); at a bucket's first call the path binds it to what
that bucket never changes, so a call is one dict lookup and a three-argument call::

    outputs = state.forward(args, env_n, n, b)   # -> forward_for_b(args, env_n, n)

Instrumentation (``StageRuntime.instrumented(wrap)``) never patches a live object: it binds a second
path of the same instance whose parts are wrapped (:func:`instrumented_path`), used while the block is
open. ``wrap(category, fn)`` sees graph replays (``"graph replays"``: the replay callable of each
(graph step, bucket), called with no arguments, or with the replay's arguments when the path passes
them), break segments (``"break segments"``), copies of live inputs (``"copy-in"``), into bridges
(``"bridge copies"``) and of outputs into their ring slot (``"output copies"``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy
import torch

from ppcompile.runtime.executors import GraphExecutor
from ppcompile.runtime.fences import FencedSlot, register_slot
from ppcompile.runtime.graph_codegen import (
    COPY_FUNCTIONS,
    GraphForward,
    GraphPathBinder,
    make_graph_forward,
    pad_marks,
    replay_passes_args,
)
from ppcompile.runtime.program import CopyPoint, Program

__all__ = ["CATEGORIES", "GraphPath", "RingSlots", "Wrap", "bind_graph_path", "copy_category",
           "instrumented_path"]

Wrap = Callable[[str, Callable[..., Any]], Callable[..., Any]]
Copier = Callable[..., None]

CATEGORIES = ("graph replays", "break segments", "copy-in", "bridge copies", "output copies")
"""What ``wrap`` is called with, one category per kind of work a graph-path call does."""


def copy_category(name: str) -> str:
    """The category of the copy function ``name`` (a key of ``codegen.COPY_FUNCTIONS``)."""
    if name.startswith("bridge"):
        return "bridge copies"
    return "output copies" if name == "copy_out" else "copy-in"


def _point_category(point: CopyPoint) -> str:
    return "copy-in" if point.kind == "copy-in" else "bridge copies"


class RingSlots:
    """An instance's output ring (``Program.output_ring``): ``depth`` slots of buffers, one per copied
    output, handed out in turn, one slot per graph-path call. The plain and instrumented paths of an
    instance share it, so their calls take turns in one order. A call writes its slot after waiting for
    the send fences on it (``fences.fence_outputs``)."""

    __slots__ = ("_next", "slots")

    def __init__(self, slots: Sequence[tuple[torch.Tensor, ...]]) -> None:
        self.slots = tuple(FencedSlot(buffers) for buffers in slots)
        for slot in self.slots:
            register_slot(slot)
        self._next = 0

    def take(self) -> FencedSlot:
        """This call's slot (``claim()`` it before writing); the next call gets the one after it."""
        slot = self.slots[self._next]
        self._next = (self._next + 1) % len(self.slots)
        return slot


class GraphPath:
    """One instance's graph path: ``path(args, env_n, n, b)`` serves a call at bucket ``b``, through the
    function bound for ``b`` at its first call (kept until the instance drops its table: :meth:`forget`)."""

    __slots__ = ("_bound", "code", "copiers", "executor", "fresh_table", "graph_steps", "marks", "pass_args",
                 "ring", "tables", "wrap_replay")

    def __init__(self, code: GraphPathBinder, graph_steps: Sequence[int], tables: Mapping[int, list[Any]],
                 executor: GraphExecutor, copiers: Sequence[Copier | None] | None, pass_args: bool = False,
                 ring: RingSlots | None = None, wrap_replay: Callable[..., Any] | None = None,
                 marks: list[int] | None = None) -> None:
        self.code = code  # the generated ``bind_graph_forward``; its source is ``code.source``
        self.graph_steps = tuple(graph_steps)  # the step index of each replay ``code`` is bound with
        self.tables = tables  # bucket -> slot table (the instance's, filled as buckets are captured)
        self.executor = executor
        self.copiers = copiers
        self.fresh_table = not executor.binds_inputs  # each call's outputs go into a copy of the table
        self.pass_args = pass_args  # replays are handed their arguments
        self.ring = ring
        self.wrap_replay = wrap_replay  # instrumentation: wraps each replay callable
        # Per static buffer, the rows written since last zeroed (``graph_codegen.pad_marks``): the
        # instance's, shared by its plain and instrumented paths (they write the same buffers).
        self.marks = [] if marks is None else marks
        self._bound: dict[int, GraphForward] = {}

    def describe(self) -> str:
        """Which variant of the generated code this is, as ``generated_code()`` names it."""
        fused = ", fused copies" if self.copiers is not None else ""
        return f"binds inputs {not self.fresh_table}, passes args {self.pass_args}{fused}"

    def __call__(self, args: Sequence[Any], env_n: Mapping[sympy.Symbol, int], n: int,
                 b: int) -> tuple[Any, ...]:
        forward = self._bound.get(b)
        if forward is None:
            forward = self._bind(b)
        return forward(args, env_n, n)

    def _bind(self, b: int) -> GraphForward:
        """Bucket ``b``'s function: its table, a replay per graph step, the copiers, the ring."""
        executor = self.executor
        replays = [executor.bound_replay((i, b)) if not self.pass_args
                   else functools.partial(executor.replay, (i, b)) for i in self.graph_steps]
        if self.wrap_replay is not None:
            replays = [self.wrap_replay(r) for r in replays]
        forward = self._bound[b] = self.code(b, self.tables[b], replays, self.copiers, self.ring, {},
                                               self.marks)
        return forward

    def forget(self, bucket: int | None = None) -> None:
        """Drops what was bound for ``bucket`` (every bucket: None); the instance calls it whenever a
        table is made or dropped."""
        if bucket is None:
            self._bound.clear()
        else:
            self._bound.pop(bucket, None)


def bind_graph_path(program: Program, stage: str, token: sympy.Symbol, tables: Mapping[int, list[Any]],
                    executor: GraphExecutor, debug: bool, copiers: Sequence[Copier | None] | None,
                    copies: Mapping[str, Copier] = COPY_FUNCTIONS, ring: RingSlots | None = None,
                    wrap_replay: Callable[..., Any] | None = None,
                    marks: list[int] | None = None) -> GraphPath:
    """Generates ``program``'s graph path for an instance (``copiers``: one per copy point, or None for
    per-tensor torch ops; ``ring``: the instance's output ring, with ``output_ring``; ``marks``: the
    instance's padding marks, new ones when None)."""
    pass_args = replay_passes_args(executor.binds_inputs, debug)
    code = make_graph_forward(program, stage, token, executor.binds_inputs, pass_args, copies,
                              fused=copiers is not None)
    graph_steps = [st.index for st in program.graph_steps]
    if marks is None:  # zero-filled buffers: no row written yet
        marks = [0] * len(set(pad_marks(program, copiers is not None).values()))
    return GraphPath(code, graph_steps, tables, executor, copiers, pass_args, ring, wrap_replay, marks)


def instrumented_path(path: GraphPath, program: Program, stage: str, token: sympy.Symbol, wrap: Wrap,
                      debug: bool) -> GraphPath:
    """``path``'s instance with every part wrapped by ``wrap`` (module docstring)."""
    def wrapped(fn: Callable[..., Any] | None) -> Any:
        return None if fn is None else wrap("break segments", fn)

    steps = tuple(st if st.is_graph else dataclasses.replace(st, fn=wrapped(st.fn), call=wrapped(st.call))
                  for st in program.steps)
    copies = {name: wrap(copy_category(name), fn) for name, fn in COPY_FUNCTIONS.items()}
    copiers = None if path.copiers is None else tuple(
        None if c is None else wrap(_point_category(point), c)
        for point, c in zip(program.copy_points, path.copiers))
    return bind_graph_path(dataclasses.replace(program, steps=steps), stage, token, path.tables,
                           path.executor, debug, copiers, copies, path.ring,
                           wrap_replay=lambda replay: wrap("graph replays", replay), marks=path.marks)

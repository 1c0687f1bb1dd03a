"""A stage instance's graph path, bound once: the generated per-call code (``codegen.py``) with the
instance's slot tables, replay and fused copiers, and its instrumented variants.

The code a graph-path call runs depends on three facts fixed when an instance exists (whether its
executor binds inputs, whether replays are handed their arguments, whether it has fused copiers), so
the instance generates it once and binds it (:class:`GraphPath`); a call is then one method call::

    outputs = state.forward(args, env_n, env_b, n, b)

Instrumentation (``StageRuntime.instrumented(wrap)``) never patches a live object: it binds a second
path of the same instance whose parts are wrapped (:func:`instrumented_path`), used while the block is
open. ``wrap(category, fn)`` sees graph replays (``"graph replays"``), break segments
(``"break segments"``), copies of live inputs (``"copy-in"``), into bridges (``"bridge copies"``) and of
outputs into their ring slot (``"output copies"``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy
import torch

from ppcompile.runtime.codegen import COPY_FUNCTIONS, GraphForward, make_graph_forward, replay_passes_args
from ppcompile.runtime.fences import FencedSlot, register_slot
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
    """One instance's graph path: ``path(args, env_n, env_b, n, b)`` serves a call at bucket ``b``."""

    __slots__ = ("_views", "code", "copiers", "fresh_table", "pass_args", "replay", "ring", "tables")

    def __init__(self, code: GraphForward, tables: Mapping[int, list[Any]], replay: Callable[..., Any],
                 copiers: Sequence[Copier | None] | None, fresh_table: bool, pass_args: bool = False,
                 ring: RingSlots | None = None) -> None:
        self.code = code  # the generated function; its source is ``code.source``
        self.tables = tables  # bucket -> slot table (the instance's, filled as buckets are captured)
        self.replay = replay
        self.copiers = copiers
        self.fresh_table = fresh_table  # a non-binding executor writes each call's outputs into a copy
        self.pass_args = pass_args  # replays are handed their arguments
        self.ring = ring
        # Per bucket: its table and the copy views made for it, by sizes (codegen._row_views).
        self._views: dict[int, tuple[list[Any], dict[tuple[int, ...], tuple[torch.Tensor, ...]]]] = {}

    def describe(self) -> str:
        """Which variant of the generated code this is, as ``generated_code()`` names it."""
        fused = ", fused copies" if self.copiers is not None else ""
        return f"binds inputs {not self.fresh_table}, passes args {self.pass_args}{fused}"

    def __call__(self, args: Sequence[Any], env_n: Mapping[sympy.Symbol, int],
                 env_b: Mapping[sympy.Symbol, int], n: int, b: int) -> tuple[Any, ...]:
        static = self.tables[b]
        ring = None if self.ring is None else self.ring.take()
        if self.fresh_table:
            return self.code(args, list(static), env_n, env_b, self.replay, n, b, self.copiers, ring)
        cached = self._views.get(b)
        if cached is None or cached[0] is not static:  # a bucket captured again has a new table
            cached = self._views[b] = (static, {})
        return self.code(args, static, env_n, env_b, self.replay, n, b, self.copiers, ring, cached[1])


def bind_graph_path(program: Program, stage: str, tables: Mapping[int, list[Any]], replay: Callable[..., Any],
                    binds_inputs: bool, debug: bool, copiers: Sequence[Copier | None] | None,
                    copies: Mapping[str, Copier] = COPY_FUNCTIONS,
                    ring: RingSlots | None = None) -> GraphPath:
    """Generates ``program``'s graph path for an instance and binds it (``copiers``: one per copy point,
    or None for per-tensor torch ops; ``ring``: the instance's output ring, with ``output_ring``)."""
    pass_args = replay_passes_args(binds_inputs, debug)
    code = make_graph_forward(program, stage, binds_inputs, pass_args, copies, fused=copiers is not None)
    return GraphPath(code, tables, replay, copiers, fresh_table=not binds_inputs, pass_args=pass_args,
                     ring=ring)


def instrumented_path(path: GraphPath, program: Program, stage: str, wrap: Wrap, binds_inputs: bool,
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
    return bind_graph_path(dataclasses.replace(program, steps=steps), stage, path.tables,
                           wrap("graph replays", path.replay), binds_inputs, debug, copiers, copies,
                           path.ring)

"""A stage instance's graph path, bound once: the generated per-call code (``codegen.py``) with the
instance's slot tables, replay and fused copiers, and its instrumented variants.

The code a graph-path call runs depends on three facts fixed when an instance exists (whether its
executor binds inputs, whether replays are handed their arguments, whether it has fused copiers), so
the instance generates it once and binds it (:class:`GraphPath`); a call is then one method call::

    outputs = state.forward(args, env_n, env_b, n, b)

Instrumentation (``StageRuntime.instrumented(wrap)``) never patches a live object: it binds a second
path of the same instance whose parts are wrapped (:func:`instrumented_path`), used while the block is
open. ``wrap(category, fn)`` sees graph replays (``"graph replays"``), break segments
(``"break segments"``), copies of live inputs (``"copy-in"``) and into bridges (``"bridge copies"``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy

from ppcompile.runtime.codegen import COPY_FUNCTIONS, GraphForward, make_graph_forward, replay_passes_args
from ppcompile.runtime.program import CopyPoint, Program

__all__ = ["CATEGORIES", "GraphPath", "Wrap", "bind_graph_path", "instrumented_path"]

Wrap = Callable[[str, Callable[..., Any]], Callable[..., Any]]
Copier = Callable[..., None]

CATEGORIES = ("graph replays", "break segments", "copy-in", "bridge copies")
"""What ``wrap`` is called with, one category per kind of work a graph-path call does."""


def _copy_category(point: CopyPoint) -> str:
    return "copy-in" if point.kind == "copy-in" else "bridge copies"


class GraphPath:
    """One instance's graph path: ``path(args, env_n, env_b, n, b)`` serves a call at bucket ``b``."""

    __slots__ = ("code", "copiers", "fresh_table", "pass_args", "replay", "tables")

    def __init__(self, code: GraphForward, tables: Mapping[int, list[Any]], replay: Callable[..., Any],
                 copiers: Sequence[Copier | None] | None, fresh_table: bool, pass_args: bool = False) -> None:
        self.code = code  # the generated function; its source is ``code.source``
        self.tables = tables  # bucket -> slot table (the instance's, filled as buckets are captured)
        self.replay = replay
        self.copiers = copiers
        self.fresh_table = fresh_table  # a non-binding executor writes each call's outputs into a copy
        self.pass_args = pass_args  # replays are handed their arguments

    def describe(self) -> str:
        """Which variant of the generated code this is, as ``generated_code()`` names it."""
        fused = ", fused copies" if self.copiers is not None else ""
        return f"binds inputs {not self.fresh_table}, passes args {self.pass_args}{fused}"

    def __call__(self, args: Sequence[Any], env_n: Mapping[sympy.Symbol, int],
                 env_b: Mapping[sympy.Symbol, int], n: int, b: int) -> tuple[Any, ...]:
        static = self.tables[b]
        if self.fresh_table:
            static = list(static)
        return self.code(args, static, env_n, env_b, self.replay, n, b, self.copiers)


def bind_graph_path(program: Program, stage: str, tables: Mapping[int, list[Any]], replay: Callable[..., Any],
                    binds_inputs: bool, debug: bool, copiers: Sequence[Copier | None] | None,
                    copies: Mapping[str, Copier] = COPY_FUNCTIONS) -> GraphPath:
    """Generates ``program``'s graph path for an instance and binds it (``copiers``: one per copy point,
    or None for per-tensor torch ops)."""
    pass_args = replay_passes_args(binds_inputs, debug)
    code = make_graph_forward(program, stage, binds_inputs, pass_args, copies, fused=copiers is not None)
    return GraphPath(code, tables, replay, copiers, fresh_table=not binds_inputs, pass_args=pass_args)


def instrumented_path(path: GraphPath, program: Program, stage: str, wrap: Wrap, binds_inputs: bool,
                      debug: bool) -> GraphPath:
    """``path``'s instance with every part wrapped by ``wrap`` (module docstring)."""
    def wrapped(fn: Callable[..., Any] | None) -> Any:
        return None if fn is None else wrap("break segments", fn)

    steps = tuple(st if st.is_graph else dataclasses.replace(st, fn=wrapped(st.fn), call=wrapped(st.call))
                  for st in program.steps)
    copies = {name: wrap("bridge copies" if name.startswith("bridge") else "copy-in", fn)
              for name, fn in COPY_FUNCTIONS.items()}
    copiers = None if path.copiers is None else tuple(
        None if c is None else wrap(_copy_category(point), c)
        for point, c in zip(program.copy_points, path.copiers))
    return bind_graph_path(dataclasses.replace(program, steps=steps), stage, path.tables,
                           wrap("graph replays", path.replay), binds_inputs, debug, copiers, copies)

"""Eager segments' code: one generated ``forward`` for segments whose graphs are the same program.

A stage of N alike layers splits into N alike graph segments that differ only in node names (and in
the weights each is handed). FX generates and compiles Python source per graph module; a segment
whose graph is the same program as one already generated (the same ops on the same wiring, the same
constants, placeholders by position: the program ``structural_key`` also keys, any object that is not a
plain value taken as itself) runs that one's ``forward`` instead. A graph that reads its module
(``get_attr``, ``call_module``) keeps its own code.

Before (layers 2 and 3's middle segments)::

    def forward(self, out, L_w2_):    linear = torch._C._nn.linear(out, L_w2_); ...
    def forward(self, out_1, L_w3_):  linear_1 = torch._C._nn.linear(out_1, L_w3_); ...

After: both call sites hold the first segment's ``forward``; the second's source is never generated.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from ppcompile.counters import counters
from ppcompile.torch_internals.tracing import has_default_codegen

from .structural_key import program_lines

__all__ = ["EagerCode", "program_of"]


class EagerCode:
    """The generated ``forward`` of graph modules, shared among those whose graphs are the same
    program (``counters.eager_code_reuses`` counts the reuses)."""

    def __init__(self) -> None:
        self._by_program: dict[Hashable, Callable[..., Any]] = {}

    def forward(self, gm: torch.fx.GraphModule) -> Callable[..., Any]:
        program = program_of(gm)
        if program is not None and (fn := self._by_program.get(program)) is not None:
            counters.eager_code_reuses += 1
            return fn
        real_recompile = getattr(gm, "real_recompile", None)  # a lazy GraphModule generates its code now
        if real_recompile is not None:
            real_recompile()
        fn = gm.forward  # itself: it skips nn.Module.__call__ (hooks, lazy-recompile check) per call
        if program is not None:
            self._by_program[program] = fn
        return fn


def program_of(gm: torch.fx.GraphModule) -> Hashable | None:
    """``gm``'s graph as a hashable program (``structural_key.program_lines``: node names left out, an
    object other than a plain value by identity), or None when its code may depend on more than that:
    a graph that reads its module, or whose code FX does not generate its default way."""
    if not has_default_codegen(gm.graph) or any(gm.graph.find_nodes(op=op)
                                                 for op in ("get_attr", "call_module")):
        return None
    return "\n".join(program_lines(gm))

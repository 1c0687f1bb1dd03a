"""Eager segments' code: one generated ``forward`` for segments whose graphs are the same program.

A stage of N alike layers splits into N alike graph segments that differ only in node names (and in
the weights each is handed). FX generates and compiles Python source per graph module; a segment
whose graph is the same program as one already generated (the same ops on the same wiring, the same
constants, placeholders by position) runs that one's ``forward`` instead. A graph that reads its
module (``get_attr``, ``call_module``) keeps its own code, and so does one holding a constant other
than a number, a string, None, or a torch dtype, device, layout or memory format.

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

__all__ = ["EagerCode"]

_VALUE_TYPES = (bool, int, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


class _Unshareable(Exception):
    pass


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
    """``gm``'s graph as a hashable program (node names left out), or None when its code may depend on
    more than that."""
    if not has_default_codegen(gm.graph):
        return None
    index: dict[torch.fx.Node, int] = {}
    items: list[Hashable] = []
    try:
        for node in gm.graph.nodes:
            if node.op in ("get_attr", "call_module"):
                return None
            target = None if node.op == "placeholder" else node.target  # placeholders by position
            items.append((node.op, target, _arg(node.args, index), _arg(node.kwargs, index)))
            index[node] = len(index)
    except _Unshareable:
        return None
    return tuple(items)


def _arg(value: Any, index: dict[torch.fx.Node, int]) -> Hashable:
    if isinstance(value, torch.fx.Node):
        return ("node", index[value])
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *(_arg(v, index) for v in value))
    if isinstance(value, dict):
        return ("dict", *((k, _arg(v, index)) for k, v in value.items()))
    if isinstance(value, slice):
        return ("slice", _arg(value.start, index), _arg(value.stop, index), _arg(value.step, index))
    if isinstance(value, float):
        return ("float", repr(value))  # 0.0 and -0.0 are equal but print differently
    if type(value) in _VALUE_TYPES:
        return (type(value).__name__, value)  # typed: 1, 1.0 and True are equal as keys
    raise _Unshareable

"""Aliasing and mutation: which graph inputs an op writes in place, through any chain of views.

One analysis, used twice: ``check_padding_safety`` asks it of each node of the stage graph (a graph
that writes an input other than a lifted one writes padded rows into it), and ``lift_static_inputs``
asks it of each segment of the split graph, recording which of the segment's arguments it writes
(``node_facts.WRITTEN_ARGS``), which lowering reads to plan refreshes, read-backs and in-place
outputs. Example (a segment ``submod_1(x, residual)`` whose body runs ``residual.add_(x)``)::

    mutated_inputs(add_)              == [residual]   # the placeholder, through views
    written_arguments_of(submod_1)    == (1,)
"""

from __future__ import annotations

from typing import Any

import torch

from ppcompile.analysis.op_matching import op_name
from ppcompile.torch_internals import OpOverload, OpOverloadPacket, tree_leaves, written_arguments

__all__ = ["VIEW_OPS", "mutated_inputs", "written_arguments_of", "written_input"]

# Ops whose output aliases their first argument (a view of it, or the tensor itself).
VIEW_OPS = frozenset((
    "getitem", "view", "reshape", "narrow", "select", "transpose", "permute", "t", "unsqueeze", "squeeze",
    "expand", "expand_as", "as_strided", "diagonal", "unflatten", "flatten", "view_as", "reshape_as",
    "movedim", "swapaxes", "swapdims", "split", "chunk", "tensor_split", "unbind", "contiguous", "detach",
))
_IN_PLACE_FUNCTIONS = frozenset(("setitem", "iadd", "isub", "imul", "itruediv", "ifloordiv", "ipow",
                                 "iand", "ior", "ixor", "imod"))


def written_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """The graph input that an in-place op writes into (through any chain of views), or None.

    A graph replays its in-place writes for all ``b`` rows: into a module buffer (a KV cache written
    by token-major slot indices, a ``cache[:n]`` view) that writes padded rows too; into a lifted live
    input it writes the static copy, which the runtime reads back (``Step.writes_buffers``).
    """
    name = op_name(node)
    in_place = (node.op == "call_method" and name.endswith("_") and not name.endswith("__")) or (
        node.op == "call_function" and name in _IN_PLACE_FUNCTIONS
    )
    if not in_place or not node.args:
        return None
    return _base_input(node.args[0])


def _base_input(value: Any) -> torch.fx.Node | None:
    """The graph input ``value`` views (through any chain of views), or None."""
    while isinstance(value, torch.fx.Node) and value.op != "placeholder":
        viewing = value.op in ("call_function", "call_method") and op_name(value) in VIEW_OPS
        if not viewing or not value.args:
            return None
        value = value.args[0]
    return value if isinstance(value, torch.fx.Node) else None


def mutated_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The graph inputs ``node`` writes in place, through views: an in-place method's ``self``
    (:func:`written_input`), every argument an op's schema marks as written (an out-variant op's
    ``out``), and the ``out=`` of a torch function (``torch.add(x, 1, out=r)``, which Dynamo keeps)."""
    written = written_input(node)
    values: list[Any] = [] if written is None else [written]
    target = node.target
    if isinstance(target, OpOverloadPacket) and target.overloads() == ["default"]:
        target = target.default  # a custom op called as ``torch.ops.ns.op(...)``
    if node.op == "call_function" and isinstance(target, OpOverload):
        for i, name in written_arguments(target):
            values.append(node.args[i] if i < len(node.args) else node.kwargs.get(name))
    elif node.op == "call_function":
        values.extend(tree_leaves(node.kwargs.get("out")))
    found: list[torch.fx.Node] = []
    for base in map(_base_input, values):
        if base is not None and base not in found:
            found.append(base)
    return found




def written_arguments_of(graph_module: torch.fx.GraphModule) -> tuple[int, ...]:
    """Positions of ``graph_module``'s inputs that its ops write in place (through views), in order."""
    placeholders = list(graph_module.graph.find_nodes(op="placeholder"))
    written = {p for node in graph_module.graph.nodes if node.op in ("call_function", "call_method")
               for p in mutated_inputs(node)}
    return tuple(i for i, p in enumerate(placeholders) if p in written)

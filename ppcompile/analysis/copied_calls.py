"""What passes that copy traced ops in place of a call need (``inline_nested_regions``,
``expand_stamped_layers``): the module a node was traced in, a copied node's module stack moved from
the call it was traced for to the call it now stands for (so passes that name modules by path,
``find_declared_regions``, tell the calls apart), and the call's results handed to its readers.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx.node import map_arg

__all__ = ["copy_node", "innermost_module", "replace_call", "restacked"]


def _innermost(stack: dict[str, Any] | None) -> str | None:
    entries = list((stack or {}).values())
    entry = entries[-1] if entries else None
    return str(entry[0]) if isinstance(entry, tuple) and len(entry) == 2 else None


def innermost_module(node: torch.fx.Node) -> str | None:
    """The path of the module ``node`` was traced in (``L['self'].layers.4.mlp``), or None."""
    return _innermost(node.meta.get("nn_module_stack"))


def restacked(
    meta: dict[str, Any], traced_at: str | None, call_stack: dict[str, Any] | None,
    shared: dict[Any, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """``meta`` with its module stack re-rooted at this call: the call's own stack (``call_stack``,
    ending at the module called), then the entries below ``traced_at`` (the module of the call the
    ops were traced for), moved under this call's module. The entries from the traced call's stack
    above it (its layer, say) are that call's, not this one's, and are dropped.

    ``shared``: the stacks already moved for this call, by the traced stack's entries (the caller's,
    for one call): the copies of the ops one module ran share one stack, rather than hold a dict and
    its entries each for as long as the compiled stage lives."""
    stack = meta.get("nn_module_stack")
    called_at = _innermost(call_stack)
    if not stack or traced_at is None or called_at is None or traced_at == called_at:
        return meta
    entries = tuple(stack.items())
    try:
        moved = shared.get(entries) if shared is not None else None
    except TypeError:  # an entry torch made of unhashable values: this stack is not shared
        moved, shared = None, None
    if moved is None:
        moved = dict(call_stack or {})
        for key, entry in stack.items():
            path = str(entry[0]) if isinstance(entry, tuple) and len(entry) == 2 else None
            if path is not None and path.startswith(traced_at + "."):
                moved[key] = (called_at + path[len(traced_at):], entry[1])
        if shared is not None:
            shared[entries] = moved
    return {**meta, "nn_module_stack": moved}


def replace_call(graph: torch.fx.Graph, call: torch.fx.Node, results: Sequence[Any], what: str) -> None:
    """Hands ``results`` (the copied ops' values) to the readers of ``call``, each of which takes one
    result by index, and erases ``call``; ``what`` names the pass's work for the error a reader of
    another kind gets."""
    for user in list(call.users):
        if user.op != "call_function" or user.target is not operator.getitem:
            raise ValueError(f"pp_breakable: {user.name} reads the results of {call.name} other than by "
                             f"index; ppcompile {what} only when each result is taken by index")
        user.replace_all_uses_with(results[user.args[1]])  # type: ignore[index]
        graph.erase_node(user)
    graph.erase_node(call)


def copy_node(graph: torch.fx.Graph, node: torch.fx.Node, lookup: Callable[[torch.fx.Node], Any],
              meta: dict[str, Any], keep_name: bool = True) -> torch.fx.Node:
    """``node`` copied into ``graph`` at its insertion point, each node it reads replaced by
    ``lookup(node)``, with the entries of ``meta`` (copied into the copy's own dict: assigning a node's
    attributes costs FX an update of its lookup table), named after ``node`` (``keep_name``) or after
    its target. ``Graph.node_copy`` does the same through a pytree walk of the arguments and a copy of the
    meta the caller replaces, and ``Graph.create_node`` walks the arguments again for raw symbolic
    numbers to warn about, which the arguments of a node already in a graph do not hold: the copy is
    created bare and given its arguments after. Passes copy thousands of nodes."""
    copy = graph.create_node(node.op, node.target, name=node.name if keep_name else None,
                             type_expr=node.type)
    if node.args:
        copy.args = map_arg(node.args, lookup)
    if node.kwargs:
        copy.kwargs = map_arg(node.kwargs, lookup)
    copy.meta.update(meta)
    return copy

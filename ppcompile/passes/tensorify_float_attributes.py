"""Pass ``tensorify_float_attributes``: float module attributes (a norm's ``eps``) stay tensor inputs.

Dynamo passes a float attribute as a 0-dim float64 CPU tensor input read with ``.item()`` (so one graph
serves instances with other values). Inductor cannot compile that ``.item()`` in a segment: Inductor's
own fix-up (``tensorify_python_scalars``) insists on seeing every float of the shape environment, and
the other segments' floats are not in this one, so it asks Dynamo to re-trace the whole stage with the
floats baked in (a second Dynamo trace: seconds for a deep stage). Instead, where the float only feeds
arithmetic with a floating tensor, use the 0-dim tensor itself: the same result dtype (a dimensioned
tensor wins type promotion over a 0-dim one, as over a Python float), the value read per call, and one
compiled segment still serves every instance. Graphs captured from it bake the value, which the stage
runtime already keys by. Only with ``segment_compiler="inductor"``: eager segments run ``.item()`` as is.

Before::

    item = l_self_eps.item()
    add = mean + item

After::

    add = mean + l_self_eps

A float used any other way is left to Dynamo: the pass asks it to re-trace with that float
specialised (a constant in the graph, guarded by value), as Inductor does for a whole graph; the pass
manager lets Dynamo's restart through unwrapped.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import sympy
import torch

from ppcompile.passes.context import PassContext, PassResult
from ppcompile.passes.find_token_dims import classify_input
from ppcompile.records import InputKind
from ppcompile.symbolic import example_value
from ppcompile.torch_internals import floats_specialized, restart_with_floats_specialized

__all__ = ["tensorify_float_attributes"]

log = logging.getLogger(__name__)

_ARITH_FUNCTIONS = frozenset({
    operator.add, operator.sub, operator.mul, operator.truediv,
    torch.add, torch.sub, torch.mul, torch.div,
})
_ARITH_METHODS = frozenset({"add", "sub", "mul", "div", "__add__", "__sub__", "__mul__", "__truediv__",
                            "__radd__", "__rsub__", "__rmul__", "__rtruediv__"})


def _floating_tensor(a: Any) -> bool:
    v = example_value(a) if isinstance(a, torch.fx.Node) else None
    return isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0


def _rewritable(use: torch.fx.Node, item: torch.fx.Node) -> bool:
    """``use`` is binary arithmetic of ``item`` (positionally) with a dimensioned floating tensor."""
    if item in use.kwargs.values() or len(use.args) != 2:
        return False
    if use.op == "call_function" and use.target in _ARITH_FUNCTIONS:
        return any(a is not item and _floating_tensor(a) for a in use.args)
    if use.op == "call_method" and use.target in _ARITH_METHODS:
        return use.args[1] is item and _floating_tensor(use.args[0])
    return False


def _float_symbol(value: torch.Tensor) -> str | None:
    memo = getattr(value, "item_memo", None)
    symbol = getattr(getattr(memo, "node", None), "_expr", None)
    return symbol.name if isinstance(symbol, sympy.Symbol) else None


def _is_symbolic(v: Any) -> bool:
    if isinstance(v, torch.SymInt):
        return True
    return isinstance(v, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in v.shape)


def tensorify_float_attributes(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Rewrites ``x op attr.item()`` to ``x op attr`` for float module attributes under Inductor
    segments. Raises Dynamo's restart (floats specialised) for any other use."""
    if ctx.config.segment_compiler != "inductor":
        return PassResult(gm, modified=False)
    rewritten = _rewrite(gm)
    if rewritten:
        log.debug("%s: %d float attribute(s) stay tensor inputs", ctx.graph_name, rewritten)
    return PassResult(gm, modified=rewritten > 0)


def _rewrite(gm: torch.fx.GraphModule) -> int:
    """The rewrite in place; returns how many attributes it rewrote."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if not any(_is_symbolic(example_value(p)) for p in placeholders):
        return 0  # concrete sizes: every segment runs eagerly, floats and all
    rewritten, leftover = 0, []
    for p in placeholders:
        v = example_value(p)
        if not isinstance(v, torch.Tensor) or classify_input(p, v) is not InputKind.CONSTANT_SCALAR:
            continue
        items = list(p.users)
        if not items or any(u.op != "call_method" or u.target != "item" for u in items):
            continue
        if all(_rewritable(use, item) for item in items for use in item.users):
            for item in items:
                item.replace_all_uses_with(p)
                gm.graph.erase_node(item)
            rewritten += 1
        elif (name := _float_symbol(v)) is not None:
            leftover.append(name)
    if rewritten:
        gm.recompile()
    if leftover:
        _restart_specialised(leftover)
    return rewritten


def _restart_specialised(names: list[str]) -> None:
    if floats_specialized(names):
        return  # asked once already: never loop
    log.info("float attributes %s feed more than arithmetic: Dynamo re-traces with them as constants "
             "for Inductor segments", names)
    restart_with_floats_specialized(names)

"""Pass ``find_token_dims``: which dims of which inputs, intermediates and outputs scale with tokens.

The token count is the symbol that Dynamo gave the leading dim of the stage's live tensor inputs
(``input_ids``, ``positions``, the PP proxies). Every node whose traced shape mentions that symbol gets
``node.meta["pp_token_dims"] = ((dim, size_expr), ...)``; numbers (a ``SymInt``, a ``torch.Size``
holding one) get ``meta["pp_size_expr"]``.
Sizes are sympy expressions after the ShapeEnv's replacements, so an output of size ``s0 // 2`` is
recorded as ``FloorDiv(s0, 2)`` and later trims to ``n // 2``.

Before (Dynamo graph; ``s0`` is the token count)::

    def forward(self, s0: Sym(s0), L_x_: f32[s0, 64], L_w_: f32[64, 64]):
        linear = torch._C._nn.linear(L_x_, L_w_)       # f32[s0, 64]
        floordiv = s0 // 2
        view = linear.view(floordiv, 128)               # f32[s0//2, 128]
        return (view,)

After (same code; meta added)::

    L_x_.meta["pp_token_dims"]   == ((0, s0),)
    linear.meta["pp_token_dims"] == ((0, s0),)
    floordiv.meta["pp_size_expr"] == s0//2
    view.meta["pp_token_dims"]   == ((0, s0//2),)
    L_w_.meta["pp_token_dims"]   == ()          # a parameter: module state, read in place
"""

from __future__ import annotations

import logging
import re
from collections import Counter

import sympy
import torch

from ppcompile.analysis.node_facts import BOUND_WEIGHT, SIZE_EXPR, TOKEN_DIMS
from ppcompile.passes.context import PassContext, PassResult
from ppcompile.records import InputKind
from ppcompile.symbolic import example_value, shape_exprs, shape_guards, size_value_expr
from ppcompile.torch_internals.frames import outside_the_call

__all__ = ["classify_input", "find_token_dims"]

log = logging.getLogger(__name__)

_MODULE_STATE_SOURCE = re.compile(r"\._(parameters|buffers)\[")
_LOCAL_SOURCE = re.compile(r"^L(\[[^\]]+\])+$")  # L['x'], L['kwargs']['scale']: passed per call


def classify_input(node: torch.fx.Node, example: object) -> InputKind:
    """Module state (parameters/buffers, read in place), live tensors, or dynamic sizes."""
    if isinstance(example, torch.SymInt):
        return InputKind.SYMINT
    if not isinstance(example, torch.Tensor):
        return InputKind.OTHER
    if isinstance(example, torch.nn.Parameter) or BOUND_WEIGHT.has(node):
        return InputKind.MODULE_STATE
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is not None and _MODULE_STATE_SOURCE.search(source.name):
        return InputKind.MODULE_STATE
    if getattr(grapharg, "pass_arg_as_tensor", False):
        per_call = source is None or _LOCAL_SOURCE.match(source.name)
        return InputKind.SCALAR_ARG if per_call else InputKind.CONSTANT_SCALAR
    if source is not None and outside_the_call(source) and not any(
            isinstance(d, torch.SymInt) for d in example.shape):
        # State the stage reaches outside its arguments (a closure cell, a global, a plain module
        # attribute: an engine's kernel handle, say): read in place like a parameter, not copied into a
        # static buffer at every call as a live input is.
        return InputKind.MODULE_STATE
    return InputKind.TENSOR


def _pick_token_symbol(
    placeholders: list[torch.fx.Node], kinds: list[InputKind]
) -> tuple[sympy.Symbol | None, tuple[int, int] | None]:
    """The token symbol and the (input, dim) that first carries it.

    Tokens are packed along the leading dim (``[T]``, ``[T, H]``): the bare symbol most often found as
    a live tensor input's leading dim wins. Failing that, the ``[1, T, ...]`` layout of batch-first
    model code, when dim 1 of every live input whose dim 0 is 1 is a bare symbol: the most common of
    them (inputs marked one by one may carry different symbols; the others stay inputs with a dynamic
    size of their own). Anything else (say a
    top-k width that stayed dynamic while a 1-token batch pinned the token dim to 1) is not the
    token count: the graph is then treated as having concrete token sizes.
    """
    tensors = [
        (i, shape_exprs(example_value(node)))
        for i, (node, kind) in enumerate(zip(placeholders, kinds))
        if kind is InputKind.TENSOR and example_value(node).dim() > 0
    ]
    votes: Counter[sympy.Symbol] = Counter()
    first: dict[sympy.Symbol, tuple[int, int]] = {}
    for i, exprs in tensors:
        if isinstance(exprs[0], sympy.Symbol):
            votes[exprs[0]] += 1
            first.setdefault(exprs[0], (i, 0))
    if votes:
        symbol = max(votes, key=lambda s: (votes[s], -first[s][0]))
        return symbol, first[symbol]
    batch_first = [(i, exprs) for i, exprs in tensors if len(exprs) > 1 and exprs[0] == 1]
    if batch_first and all(isinstance(exprs[1], sympy.Symbol) for _, exprs in batch_first):
        for i, exprs in batch_first:  # the most common symbol, the first input's on a tie
            votes[exprs[1]] += 1
            first.setdefault(exprs[1], (i, 1))
        symbol = max(votes, key=lambda s: (votes[s], -first[s][0]))
        return symbol, first[symbol]
    return None, None


def find_token_dims(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Annotates token dims on every node; fills ``ctx.token_symbol``, ``input_kinds``, ``token_input`` and
    ``token_guards`` (Dynamo's guards on the token count: buckets where one fails are not captured)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    examples = [example_value(p) for p in placeholders]
    ctx.input_kinds = [classify_input(p, ex) for p, ex in zip(placeholders, examples)]
    ctx.token_symbol, ctx.token_input = _pick_token_symbol(placeholders, ctx.input_kinds)
    token = ctx.token_symbol
    if token is None:
        log.info("%s: no dynamic token dim (Dynamo traced concrete sizes); the stage runs eagerly "
                 "until Dynamo recompiles it dynamic", ctx.graph_name)
        return PassResult(gm, modified=False)

    others: set[sympy.Symbol] = set()
    # By traced value: the copies of a stamped layer's ops share their exemplar's traced values.
    dims_of: dict[int, tuple[tuple[int, sympy.Expr], ...]] = {}
    for node in gm.graph.nodes:
        value = example_value(node)
        if isinstance(value, torch.Tensor):
            dims = dims_of.get(id(value))
            if dims is None:
                exprs = shape_exprs(value)
                dims = dims_of[id(value)] = tuple((d, e) for d, e in enumerate(exprs)
                                                  if token in e.free_symbols)
                for e in exprs:
                    others.update(e.free_symbols - {token})
            TOKEN_DIMS.set(node, dims)
        elif (expr := size_value_expr(value)) is not None:
            SIZE_EXPR.set(node, expr)
            others.update(expr.free_symbols - {token})
    for i, node in enumerate(placeholders):
        if ctx.input_kinds[i] is InputKind.SYMINT:
            ctx.symint_inputs[i] = SIZE_EXPR.of(node)
    ctx.other_symbols = frozenset(others)
    i, d = ctx.token_input or (0, 0)
    ctx.token_guards = shape_guards(example_value(placeholders[i]).shape[d], token)
    log.debug("%s: token symbol %s (input %d dim %d); other symbols %s",
              ctx.graph_name, token, *ctx.token_input or (-1, -1), sorted(map(str, others)))
    return PassResult(gm, modified=False)

"""Pass ``find_token_dims``: which dims of which inputs, intermediates and outputs scale with tokens.

The token count is the symbol that Dynamo gave the leading dim of the stage's live tensor inputs
(``input_ids``, ``positions``, the PP proxies). Every node whose traced shape mentions that symbol gets
``node.meta["pp_token_dims"] = ((dim, size_expr), ...)``; numbers (a ``SymInt``, a ``torch.Size``
holding one) get ``meta["pp_size_expr"]``.
Sizes are sympy expressions after the ShapeEnv's replacements, so an output of size ``s0 // 2`` is
recorded as ``FloorDiv(s0, 2)`` and later trims to ``n // 2``.

Inputs marked dynamic one by one (``torch._dynamo.mark_dynamic`` per tensor, as vLLM marks
``input_ids``, ``positions`` and each PP proxy) get a symbol each (``s0``, ``s80``) unless an op
relates them. Bare symbols of call arguments' token dims that were equal (and at least 2) at the traced
call are one token count: they are merged into the token symbol (``symbolic.merge_symbols``; every
size reads ``s80`` as ``s0`` from then on), so ops that read ``positions`` are no
non-token-shape breaks. ``ctx.merged_token_dims`` lists the inputs that carried them: each call checks
that their sizes agree, and a call where they differ runs eagerly (``runtime/token_counts.py``).

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
from collections.abc import Set
from typing import Any

import sympy
import torch

from ppcompile.analysis.node_facts import BOUND_WEIGHT, SIZE_EXPR, TOKEN_DIMS
from ppcompile.analysis.op_matching import request_metadata_inputs
from ppcompile.passes.context import PassContext, PassResult
from ppcompile.records import InputKind
from ppcompile.symbolic import (
    example_value,
    merge_symbols,
    merged_symbols,
    shape_exprs,
    shape_guards,
    size_expr,
    size_hints,
    size_value_expr,
)
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


_Carrier = tuple[int, int, sympy.Symbol, Any]  # (input, dim, its bare symbol, the SymInt)
_MIN_MERGED_HINT = 2  # sizes 0 and 1 are Dynamo's constants; a 1 matches every batch dim of 1


def _merge_key(symbol: sympy.Symbol, carriers: list[_Carrier], placeholders: list[torch.fx.Node]) -> object:
    """Symbols with one key are one token count: the traced value of a symbol (its hint) when it is the
    token dim of call arguments only (no global, closure or module attribute) and at least 2; else the
    symbol alone (never merged)."""
    hint = size_hints(carriers[0][3]).get(symbol)
    if hint is None or hint < _MIN_MERGED_HINT:
        return symbol
    for i, _, _, _ in carriers:
        source = getattr(placeholders[i].meta.get("grapharg"), "source", None)
        if source is not None and outside_the_call(source):
            return symbol
    return ("hint", hint)


def _vote(
    carriers: list[_Carrier], placeholders: list[torch.fx.Node]
) -> tuple[sympy.Symbol, tuple[int, int], tuple[sympy.Symbol, ...]]:
    """The token symbol, the (input, dim) that first carries it, and the symbols merged into it.

    Inputs marked dynamic one by one (``torch._dynamo.mark_dynamic`` per tensor, as vLLM marks
    ``input_ids``, ``positions`` and each PP proxy) get a symbol each: those equal at the traced call
    (``_merge_key``) vote together and are one token count. The group with the most inputs wins (the
    first input's on a tie); its symbol is the first input's, or one an earlier graph of the same trace
    merged others into."""
    by_symbol: dict[sympy.Symbol, list[_Carrier]] = {}
    for c in carriers:
        by_symbol.setdefault(c[2], []).append(c)
    groups: dict[object, list[sympy.Symbol]] = {}
    for symbol, cs in by_symbol.items():
        groups.setdefault(_merge_key(symbol, cs, placeholders), []).append(symbol)

    def score(key: object) -> tuple[int, int]:
        members = groups[key]
        return sum(len(by_symbol[m]) for m in members), -min(by_symbol[m][0][0] for m in members)

    members = groups[max(groups, key=score)]
    targets = set(merged_symbols(carriers[0][3]).values())
    symbol = next((m for m in members if m in targets), members[0])  # members: in input order
    first = by_symbol[symbol][0]
    return symbol, (first[0], first[1]), tuple(m for m in members if m != symbol)


def _pick_token_symbol(
    placeholders: list[torch.fx.Node], kinds: list[InputKind], metadata: Set[torch.fx.Node] = frozenset()
) -> tuple[sympy.Symbol | None, tuple[int, int] | None, tuple[sympy.Symbol, ...]]:
    """The token symbol, the (input, dim) that first carries it, and the symbols merged into it.

    Tokens are packed along the leading dim (``[T]``, ``[T, H]``): the bare symbol most often found as
    a live tensor input's leading dim wins (symbols of inputs marked one by one that are equal at the
    traced call count as one, ``_vote``). Failing that, the ``[1, T, ...]`` layout of batch-first
    model code, when dim 1 of every live input whose dim 0 is 1 is a bare symbol: the most common of
    them, voted alike. Anything else (say a top-k width that stayed dynamic while a 1-token batch
    pinned the token dim to 1) is not the token count: the graph is then treated as having concrete
    token sizes. Inputs in ``metadata`` (a capturable op's per-request metadata: a block table
    ``[1, M]`` of one request is no ``[1, T]``) never carry it.
    """
    tensors = [
        (i, example_value(node), shape_exprs(example_value(node)))
        for i, (node, kind) in enumerate(zip(placeholders, kinds))
        if kind is InputKind.TENSOR and example_value(node).dim() > 0 and node not in metadata
    ]
    leading = [(i, 0, exprs[0], value.shape[0]) for i, value, exprs in tensors
               if isinstance(exprs[0], sympy.Symbol)]
    if leading:
        return _vote(leading, placeholders)
    batch_first = [(i, value, exprs) for i, value, exprs in tensors if len(exprs) > 1 and exprs[0] == 1]
    if batch_first and all(isinstance(exprs[1], sympy.Symbol) for _, _, exprs in batch_first):
        return _vote([(i, 1, exprs[1], value.shape[1]) for i, value, exprs in batch_first], placeholders)
    return None, None, ()


def _merge(placeholders: list[torch.fx.Node], ctx: PassContext, merged: tuple[sympy.Symbol, ...]) -> None:
    """Reads ``merged`` as the token symbol from now on, and records which inputs carried them."""
    assert ctx.token_symbol is not None and ctx.token_input is not None
    i, d = ctx.token_input
    dims = []
    for k, (node, kind) in enumerate(zip(placeholders, ctx.input_kinds)):
        value = example_value(node)
        if kind is InputKind.TENSOR and value.dim() > d and (symbol := size_expr(value.shape[d])) in merged:
            dims.append((k, d, str(symbol)))
    merge_symbols(example_value(placeholders[i]).shape[d], merged, ctx.token_symbol)
    ctx.merged_token_dims = tuple(dims)
    log.info("%s: inputs marked dynamic one by one, equal at the traced call, are one token count %s: %s",
             ctx.graph_name, ctx.token_symbol,
             ", ".join(f"{placeholders[k].name} dim {dim} ({symbol})" for k, dim, symbol in dims))


def find_token_dims(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Annotates token dims on every node; fills ``ctx.token_symbol``, ``input_kinds``, ``token_input``,
    ``merged_token_dims`` and ``token_guards`` (Dynamo's guards on the token count: buckets where one
    fails are not captured)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    examples = [example_value(p) for p in placeholders]
    ctx.input_kinds = [classify_input(p, ex) for p, ex in zip(placeholders, examples)]
    ctx.token_symbol, ctx.token_input, merged = _pick_token_symbol(placeholders, ctx.input_kinds,
                                                                   request_metadata_inputs(gm))
    token = ctx.token_symbol
    if token is None:
        log.info("%s: no dynamic token dim (Dynamo traced concrete sizes); the stage runs eagerly "
                 "until Dynamo recompiles it dynamic", ctx.graph_name)
        return PassResult(gm, modified=False)
    if merged:
        _merge(placeholders, ctx, merged)

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

"""Pass ``check_padding_safety``: prove graphed regions keep token rows independent; flag what does not.

A graph replays ``b`` rows where only ``n`` are live. That is correct only if no graphed op mixes rows
along the token dim: a mean or sum over tokens, a cumsum, a sort or top-k along tokens, attention written
out in plain ops, a matmul contracting over tokens, an index or gather that addresses other tokens, a
``view`` that folds tokens into another dim, an in-place write into module state (a KV cache written
by slot indices would receive padded rows). For every node that touches a token dim this pass applies
the op's rule (``analysis.token_locality.RULES``); a node that fails, or whose op has no rule and is not
registered token-local, gets ``meta["pp_unsafe"]`` with the reason. Nodes of a region declared
token-local (``find_declared_regions``) skip the op rules, and collectives take the verdict
``find_collectives`` recorded. Whatever its op, a node is unsafe when a
token-dim size it makes or reads shrinks as the token count grows, or when it writes into a graph input
other than a token-major live one (whose static buffer the runtime reads back after the write).
``split_at_breaks`` then makes it a break that runs eagerly on live rows, or, with
``on_unsafe="error"``, compilation fails naming the op, its source line and the reason.

Before (``s0`` tokens)::

    linear = torch._C._nn.linear(L_x_, L_w_)        # f32[s0, 64]
    mean = linear.mean(0, keepdim=True)             # f32[1, 64]: a mean over tokens
    sub = linear - mean
    return (sub,)

After (same code)::

    linear.meta                   # no "pp_unsafe": contracts features only
    mean.meta["pp_unsafe"] == "Tensor.mean reduces along the token dim"
    sub.meta                      # elementwise, broadcasts [1, 64] over rows: token-local
"""

from __future__ import annotations

import logging
from typing import Any

import sympy
import torch

from ppcompile.analysis.mutation import mutated_inputs
from ppcompile.analysis.node_facts import COLLECTIVE, PADDING_UNSAFE, TOKEN_LOCAL, token_dims
from ppcompile.analysis.op_matching import OpMatcher, always_split_ops, engine_entry, op_name, resolve_op
from ppcompile.analysis.prefix_causal import CONV_OPS, Tail, causal_conv_tail, escaping_tails
from ppcompile.analysis.token_locality import is_registered_token_local, rule_for
from ppcompile.engine_ops import OpRole
from ppcompile.errors import source_line
from ppcompile.passes.context import PassContext, PassResult
from ppcompile.records import InputKind
from ppcompile.symbolic import SizeFn, example_value, first_decrease, shape_exprs

__all__ = ["PaddingSafetyError", "check_padding_safety"]

log = logging.getLogger(__name__)


class PaddingSafetyError(ValueError):
    """A graphed op mixes token rows and ``on_unsafe="error"`` asked to fail."""


def _op_label(node: torch.fx.Node) -> str:
    """How messages name an op: its name, a method as ``Tensor.<name>``."""
    return f"Tensor.{op_name(node)}" if node.op == "call_method" else op_name(node)


def _touches_tokens(node: torch.fx.Node) -> bool:
    if token_dims(node):
        return True
    return any(token_dims(a) for a in node.all_input_nodes)


def shrinking_token_size(
    node: torch.fx.Node, token: sympy.Symbol | None, cap: int, memo: dict[sympy.Expr, int | None]
) -> str | None:
    """Why a graph cannot hold ``node``'s values, if a token-dim size of its value or of a tensor it
    reads decreases somewhere as the token count grows (a pad count ``(64 - n % 64) % 64``): a bucket
    ``b > n`` would then hold fewer rows than the live count ``n`` has."""
    if token is None:
        return None
    nodes = [node, *(a for a in node.all_input_nodes if token_dims(a))]
    for value in nodes:
        for _, expr in token_dims(value):
            if expr not in memo:
                memo[expr] = first_decrease(expr, token, cap)
            n = memo[expr]
            if n is not None:
                rows = SizeFn(expr)
                return (f"has a token-dim size {expr} that shrinks as the token count grows ({n} tokens: "
                        f"{rows({token: n})} rows, {n + 1} tokens: {rows({token: n + 1})} rows)")
    return None


def _verdict(
    node: torch.fx.Node, ctx: PassContext, extra_safe: list[Any], cap: int,
    memo: dict[sympy.Expr, int | None], lifted: frozenset[torch.fx.Node],
) -> str | None:
    """Why ``node`` may not run on padded rows, or None. A write into a ``lifted`` input (a token-major
    live tensor: graphs get its static buffer) is judged like any other op: the runtime reads it back
    from the buffer; a write into any other graph input (module state) is never token-local."""
    shrinking = shrinking_token_size(node, ctx.token_symbol, cap, memo)
    # In-place methods, out=, and ops whose schema writes.
    written = next((p for p in mutated_inputs(node) if p not in lifted), None)
    collective = COLLECTIVE.get(node)
    entry = engine_entry(node)
    declared = TOKEN_LOCAL.has(node) or (collective is not None and collective.unsafe is None) or (
        node.op == "call_function" and is_registered_token_local(node.target, extra_safe)
    ) or (entry is not None and entry.role is OpRole.TOKEN_LOCAL)
    if shrinking is None and written is None and declared:
        return None
    rule = rule_for(node)
    if shrinking is not None:
        return f"{_op_label(node)} {shrinking}"
    if written is not None:
        return (f"{_op_label(node)} writes in place into graph input {written.name}, which is not a "
                "token-major live input: a replay would write its padded rows too")
    if collective is not None and collective.unsafe is not None:
        return f"{_op_label(node)} {collective.unsafe}"
    if rule is None:
        return (f"{_op_label(node)} is not known to be token-local (register it if it is; if it writes "
                "state outside its outputs, such as a KV cache through a context, list it in split_ops)")
    problem = rule(node)
    return None if problem is None else f"{_op_label(node)} {problem}"


def _flag(node: torch.fx.Node, reason: str, ctx: PassContext) -> None:
    if ctx.config.on_unsafe == "error":
        raise PaddingSafetyError(
            f"pp_breakable: {reason}, so padded rows would leak into live rows "
            f"({ctx.graph_name}, node {node.name}, at {source_line(node)}). Use on_unsafe='break' "
            f"to run it eagerly, or register it with ppcompile.register_token_local_op if it is "
            f"token-local (an op that writes state outside its outputs, such as a KV cache through a "
            f"context, is not: list it in split_ops)."
        )
    PADDING_UNSAFE.set(node, reason)
    log.info("%s: %s at %s: runs eagerly (padding safety)", ctx.graph_name, reason, source_line(node))


def check_padding_safety(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Marks row-mixing nodes ``meta["pp_unsafe"]``; raises instead when ``on_unsafe="error"``."""
    token = ctx.token_symbol
    if token is None:
        return PassResult(gm, modified=False)
    breaks = OpMatcher([*always_split_ops(), *ctx.config.split_ops])
    extra_safe = [resolve_op(op) for op in ctx.config.token_local_ops]
    cap = max(ctx.config.capture_sizes or (ctx.config.max_capture_tokens,))
    decreases: dict[sympy.Expr, int | None] = {}
    tails: dict[torch.fx.Node, Tail] = {}
    lifted = frozenset(p for p, kind in zip(gm.graph.find_nodes(op="placeholder"), ctx.input_kinds)
                       if kind is InputKind.TENSOR and token_dims(p))
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method") or breaks.matches(node):
            continue
        if not _touches_tokens(node):
            continue
        reason = _verdict(node, ctx, extra_safe, cap, decreases, lifted)
        if reason is not None:
            _flag(node, reason, ctx)
        elif op_name(node).split(".")[0] in CONV_OPS and isinstance(tail := causal_conv_tail(node), Tail):
            tails[node] = tail

    def stays_graphed(node: torch.fx.Node) -> bool:
        value = example_value(node)
        exprs = shape_exprs(value) if isinstance(value, torch.Tensor) else ()
        return (node.op in ("call_function", "call_method") and not PADDING_UNSAFE.has(node)
                and not TOKEN_LOCAL.has(node) and not breaks.matches(node)
                and not any(e.free_symbols & ctx.other_symbols for e in exprs))

    for origin, reached in escaping_tails(gm, tails, stays_graphed, token, cap).items():
        _flag(origin, f"{_op_label(origin)} makes rows past the live ones that read padding (a causal "
                      f"conv's tail), and {reached} reads them before a prefix slice cuts them off", ctx)
    unsafe = sum(PADDING_UNSAFE.has(n) for n in gm.graph.nodes)
    log.debug("%s: %d padding-unsafe nodes", ctx.graph_name, unsafe)
    return PassResult(gm, modified=False)

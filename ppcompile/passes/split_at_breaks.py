"""Pass ``split_at_breaks``: cut the stage graph into graph segments and break segments.

Break nodes run eagerly on live-size tensors between graph segments: attention ops (the registered
attention ops and ``scaled_dot_product_attention``), every op in the ``split_ops`` option (matched as
``OpOverload`` or packet), nodes whose shapes or size arguments depend on a dynamic symbol other than
the token count, nodes that read a Python number passed per call (a graph captured per token bucket
would replay a stale value), nodes ``check_capture_safety`` found a CUDA graph cannot capture, and
nodes ``check_padding_safety`` found mixing token rows. Adjacent breaks (no op between them, or only
views and size arithmetic, which ``fold_tiny_graphs`` folds) are one break segment. Each kind's row of
``records.BREAK_KINDS`` says how: a run of breaks of one ``RunMerge.EXTEND`` kind (padding-unsafe ops, say)
has one reason naming every op of the run; any other break (the next attention op, the KV-cache write
beside an attention op) joins the run, named in the reason's detail.
``getitem`` nodes that unpack a break op's tuple stay with it. The split keeps the original node order
(in-place ops stay where they were); it is ``split_module``'s, built in one walk by
``analysis.ordered_split`` (partitions follow the graph order), or by ``split_module`` where that does
not apply.

Before::

    def forward(self, s0, L_x_, L_w_):
        linear = torch._C._nn.linear(L_x_, L_w_)
        attention = torch.ops.ppcompile.attention(linear, linear, linear, 0)
        relu = torch.relu(attention)
        return (relu,)

After::

    def forward(self, s0, L_x_, L_w_):
        submod_0 = self.submod_0(L_x_, L_w_)    # graph segment
        submod_1 = self.submod_1(submod_0)      # break: attention, global layer 0
        submod_2 = self.submod_2(submod_1)      # graph segment
        return (submod_2,)

each call node gets ``meta["pp_segment"]`` (``node_facts.segments(split)`` lists them in order).
"""

from __future__ import annotations

import dataclasses
import logging
import operator

import sympy
import torch
from torch.fx.passes.split_module import split_module

from ppcompile.analysis.node_facts import (
    BREAK_CAUSE,
    CAPTURE_UNSAFE,
    EAGER_REGION,
    LAYER_ID,
    PADDING_UNSAFE,
    SEGMENT,
    SIZE_EXPR,
    TOKEN_DIMS,
    TOKEN_LOCAL,
    segments,
)
from ppcompile.analysis.op_matching import OpMatcher, always_split_ops, engine_entry, op_name
from ppcompile.analysis.ordered_split import split_in_order
from ppcompile.analysis.partitions import atomic_regions, fold_tiny_graphs
from ppcompile.engine_ops import OpRole
from ppcompile.passes.context import PassContext, PassResult
from ppcompile.records import BREAK_KINDS, BreakKind, BreakReason, InputKind, RunMerge, Segment
from ppcompile.symbolic import example_value, shape_exprs, size_expr
from ppcompile.torch_internals import tree_leaves
from ppcompile.tracing.regions import is_library_label

__all__ = ["split_at_breaks"]

log = logging.getLogger(__name__)

_COPIED_META = ("example_value", "val", TOKEN_DIMS.key, SIZE_EXPR.key)


def _mentions_other_symbols(node: torch.fx.Node, ctx: PassContext) -> bool:
    if not ctx.other_symbols:
        return False
    value = example_value(node)
    exprs: list[sympy.Expr] = []
    if isinstance(value, torch.Tensor):
        exprs.extend(shape_exprs(value))
    elif isinstance(value, torch.SymInt):
        exprs.append(size_expr(value))
    # A size argument baked into a graph at capture would be replayed with a stale value.
    for arg in tree_leaves((node.args, node.kwargs)):
        if isinstance(arg, torch.fx.Node) and (expr := SIZE_EXPR.get(arg)) is not None:
            exprs.append(expr)
        elif isinstance(arg, torch.fx.Node) and isinstance(example_value(arg), torch.Tensor):
            exprs.extend(shape_exprs(example_value(arg)))  # a graph cannot read it at a fixed size
    return any(e.free_symbols & ctx.other_symbols for e in exprs)


def _break_reason(
    node: torch.fx.Node, ctx: PassContext, attention: OpMatcher, user: OpMatcher, host: set[torch.fx.Node]
) -> BreakReason | None:
    trace = node.meta.get("stack_trace")
    reads_host = any(a in host for a in node.all_input_nodes)
    if reads_host and not isinstance(example_value(node), torch.Tensor):
        host.add(node)  # a number derived from a per-call scalar: its readers run eagerly too
    if (region := EAGER_REGION.get(node)) is not None and not is_library_label(region):
        return BreakReason(BreakKind.EAGER_REGION, op_name(node, qualified=True),
                           f"traced inside {region}, declared an eager region", trace)
    if (entry := engine_entry(node)) is not None and entry.role is OpRole.STATE_WRITE:
        return BreakReason(BreakKind.STATE_WRITE, op_name(node, qualified=True),
                           f"writes {entry.writes} through {entry.engine}'s forward context", trace)
    if attention.matches(node):
        layer = LAYER_ID.get(node)
        detail = f"global layer {layer}" if layer is not None else ""
        return BreakReason(BreakKind.ATTENTION, op_name(node, qualified=True), detail, trace)
    if user.matches(node):
        return BreakReason(BreakKind.USER_SPLIT_OP, op_name(node, qualified=True), "listed in split_ops",
                           trace)
    if node.op in ("call_function", "call_method") and _mentions_other_symbols(node, ctx):
        others = ", ".join(sorted(str(s) for s in ctx.other_symbols))
        return BreakReason(
            BreakKind.NON_TOKEN_SHAPE, op_name(node, qualified=True),
            f"depends on {others}, not only on the token count", trace,
        )
    if (why := CAPTURE_UNSAFE.get(node)) is not None:
        return BreakReason(BreakKind.CAPTURE_UNSAFE, op_name(node, qualified=True), why, trace)
    if (why := PADDING_UNSAFE.get(node)) is not None:
        return BreakReason(BreakKind.UNSAFE_OP, op_name(node, qualified=True), why, trace)
    if reads_host:
        return BreakReason(
            BreakKind.HOST_SCALAR, op_name(node, qualified=True),
            "reads a Python number passed per call, which a graph would replay stale", trace,
        )
    return None


def _extends(run: BreakReason, reason: BreakReason) -> bool:
    """Whether ``reason``'s break extends the run of breaks ``run`` names (one kind, merged by naming every
    op: its ``BREAK_KINDS`` rule) rather than joining it in the detail."""
    return reason.kind is run.kind and BREAK_KINDS[reason.kind].merge is RunMerge.EXTEND


def _extend(reason: BreakReason, node: torch.fx.Node) -> BreakReason:
    """The reason of a run of breaks of one kind: its first node's, naming every op of the run."""
    ops = reason.op.split(", ")
    name = op_name(node, qualified=True)
    return reason if name in ops else dataclasses.replace(reason, op=f"{reason.op}, {name}")


def _join(first: BreakReason, second: BreakReason) -> BreakReason:
    """The reason of a break segment that ``second``'s break joined right after ``first``'s."""
    joined = f"joined with the next break ({second.kind.value}: {second.op})"
    if joined in first.detail:
        return first
    return dataclasses.replace(first, detail=f"{first.detail}; {joined}" if first.detail else joined)


def _has_tensor_output(submod: torch.fx.GraphModule) -> bool:
    (out,) = submod.graph.find_nodes(op="output")
    values = torch.fx.node.map_arg(out.args, lambda n: n)
    flat = tree_leaves(values)
    return any(isinstance(n, torch.fx.Node) and isinstance(example_value(n), torch.Tensor) for n in flat)


def _annotate_outputs(split: torch.fx.GraphModule, call: torch.fx.Node, submod: torch.fx.GraphModule) -> None:
    """Copies the traced value and token dims of a segment's outputs onto its nodes in ``split``."""
    (out,) = submod.graph.find_nodes(op="output")
    result = out.args[0]
    if isinstance(result, (tuple, list)):
        for user in call.users:
            if user.op == "call_function" and user.target is operator.getitem:
                src = result[user.args[1]]  # type: ignore[index]
                if isinstance(src, torch.fx.Node):
                    user.meta.update({k: v for k, v in src.meta.items() if k.startswith(_COPIED_META)})
    elif isinstance(result, torch.fx.Node):
        call.meta.update({k: v for k, v in result.meta.items() if k.startswith(_COPIED_META)})


def split_at_breaks(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Splits ``gm`` into ``submod_<i>`` segments, each recorded on its call node (``SEGMENT``)."""
    attention = OpMatcher(always_split_ops())
    user = OpMatcher(ctx.config.split_ops)
    host = {p for p, kind in zip(gm.graph.find_nodes(op="placeholder"), ctx.input_kinds)
            if kind is InputKind.SCALAR_ARG}
    partition: dict[torch.fx.Node, int] = {}
    reasons: dict[int, BreakReason] = {}
    layer_ids: dict[int, tuple[int, ...]] = {}
    part = 0
    current_is_break = False
    regions = atomic_regions(gm, lambda n: _break_reason(n, ctx, attention, user, host))
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node in regions:  # an uncuttable span with a break: one break partition for all of it
            start, region_reason = regions[node]
            if node is start:
                BREAK_CAUSE.set(node, region_reason)
            if node is start and current_is_break:
                reasons[part] = _join(reasons[part], region_reason)
            elif node is start:
                part += 1
                reasons[part] = region_reason
                current_is_break = True
            partition[node] = part
            continue
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in partition:
            parent = partition[node.args[0]]
            # Only tuple unpacking: indexing a tensor (``t[idx]``) may read nodes of later segments.
            if parent in reasons and not isinstance(example_value(node.args[0]), torch.Tensor):
                partition[node] = parent
                continue
        reason = _break_reason(node, ctx, attention, user, host)
        if reason is not None:
            BREAK_CAUSE.set(node, reason)
        if reason is None:
            if current_is_break:
                part += 1
                current_is_break = False
        elif current_is_break and _extends(reasons[part], reason):
            reasons[part] = _extend(reasons[part], node)  # one break for a run of one kind
        elif current_is_break:  # adjacent breaks of different kinds: one break segment
            reasons[part] = _join(reasons[part], reason)
            if (layer_id := LAYER_ID.get(node)) is not None:
                layer_ids[part] = (*layer_ids.get(part, ()), layer_id)
        else:
            part += 1
            reasons[part] = reason
            if (layer_id := LAYER_ID.get(node)) is not None:
                layer_ids[part] = (layer_id,)
            current_is_break = True
        partition[node] = part

    folded = fold_tiny_graphs(partition, reasons, layer_ids, ctx.config.fold_graph_ops)
    declared: dict[int, dict[str, None]] = {}
    for node, index in partition.items():
        if (region := TOKEN_LOCAL.get(node)) is not None:
            declared.setdefault(index, {})[region] = None
    split = split_in_order(gm, partition) or split_module(gm, gm, lambda n: partition[n],
                                                           keep_original_order=True)
    for node in split.graph.find_nodes(op="call_module"):
        index = int(str(node.target).rsplit("_", 1)[1])
        submod = getattr(split, str(node.target))
        reason = reasons.get(index)
        if reason is None and not _has_tensor_output(submod):
            calls = (n for n in submod.graph.nodes if n.op.startswith("call_"))
            ops = dict.fromkeys(op_name(n, qualified=True) for n in calls)
            reason = BreakReason(BreakKind.NO_TENSOR_OUTPUTS, ", ".join(ops), "computes only numbers")
        segment = Segment(
            name=str(node.target),
            kind="graph" if reason is None else "break",
            num_nodes=sum(1 for n in submod.graph.nodes if n.op not in ("placeholder", "output")),
            reason=reason,
            layer_ids=layer_ids.get(index, ()),
            token_local_regions=tuple(declared.get(index, ())),
        )
        SEGMENT.set(node, segment)
        _annotate_outputs(split, node, submod)
    made = segments(split)
    n_graph = sum(s.is_graph for s in made)
    log.debug("%s: %d segments (%d graph, %d break; %d tiny graph segments folded)", ctx.graph_name,
              len(made), n_graph, len(made) - n_graph, folded)
    return PassResult(split, modified=True)

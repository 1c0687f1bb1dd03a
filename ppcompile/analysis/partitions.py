"""Partition helpers of ``split_at_breaks``: spans no segment boundary may cut, and folding tiny graph
segments into the breaks around them.

Both work on a partition of the stage graph's nodes (node -> partition index) with a ``BreakReason`` per
break partition. For a graph ``linear -> attention -> add -> attention`` with ``fold_graph_ops=3``::

    partition   {linear: 0, attention: 1, add: 2, attention_1: 3}, reasons {1: ATTENTION, 3: ATTENTION}
    folded      {linear: 0, attention: 1, add: 1, attention_1: 1}, reasons {1: ATTENTION (joined ...)}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ppcompile.analysis.mutation import VIEW_OPS
from ppcompile.analysis.node_facts import EAGER_REGION, TOKEN_LOCAL
from ppcompile.analysis.op_matching import op_name
from ppcompile.records import BreakReason
from ppcompile.symbolic import example_value

__all__ = ["atomic_regions", "fold_tiny_graphs", "uncuttable_spans"]


def uncuttable_spans(gm: torch.fx.GraphModule) -> list[tuple[list[torch.fx.Node], str]]:
    """Spans of nodes that no segment boundary may cut, each with a description.

    A ``torch.vmap`` region (Dynamo inlines one as ``_vmap_increment_nesting`` ...
    ``_vmap_decrement_nesting``): a boundary inside would run copies at the wrong vmap level. A declared
    token-local region (a run of nodes with one ``meta["pp_token_local"]``): its inner values (tokens
    sorted by expert) are not token-major, so a live-size view of one would read the wrong rows. A
    declared eager region (``meta["pp_eager_region"]``): one break by declaration.
    Overlapping spans merge.
    """
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    intervals: list[tuple[int, int, str]] = []  # [first, last] node indices
    depth, opened = 0, 0
    for i, node in enumerate(nodes):
        name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
        if name == "_vmap_increment_nesting":
            opened = i if depth == 0 else opened
            depth += 1
        elif name == "_vmap_decrement_nesting" and depth:
            depth -= 1
            if depth == 0:
                intervals.append((opened, i, "torch.vmap region"))
        declared = TOKEN_LOCAL.get(node)
        if declared is None:
            declared = EAGER_REGION.get(node)
        if declared is not None:
            if intervals and intervals[-1][2] == declared and intervals[-1][1] == i - 1:
                intervals[-1] = (intervals[-1][0], i, declared)
            else:
                intervals.append((i, i, declared))
    merged: list[tuple[int, int, str]] = []
    for first, last, what in sorted(intervals):
        if merged and first <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(last, merged[-1][1]), merged[-1][2])
        else:
            merged.append((first, last, what))
    return [(nodes[first:last + 1], what) for first, last, what in merged]


def atomic_regions(
    gm: torch.fx.GraphModule, reason_of: Callable[[torch.fx.Node], BreakReason | None]
) -> dict[torch.fx.Node, tuple[torch.fx.Node, BreakReason]]:
    """Nodes of each uncuttable span (:func:`uncuttable_spans`) that holds a break, mapped to the span's
    first node and one reason: such a span becomes one break as a whole."""
    regions: dict[torch.fx.Node, tuple[torch.fx.Node, BreakReason]] = {}
    for members, what in uncuttable_spans(gm):
        found = [r for r in map(reason_of, members) if r is not None]
        if found:
            calls = (n for n in members if n.op.startswith("call_"))
            ops = ", ".join(dict.fromkeys(op_name(n, qualified=True) for n in calls))
            reason = dataclasses.replace(found[0], op=f"{what} ({ops})")
            regions.update({n: (members[0], reason) for n in members})
    return regions


def _launches(node: torch.fx.Node) -> bool:
    """Whether ``node`` runs a kernel: not a view, a tuple unpacking or size arithmetic."""
    if node.op not in ("call_function", "call_method") or not isinstance(example_value(node), torch.Tensor):
        return False
    name = str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", "")
    return name == "contiguous" or name not in VIEW_OPS


def fold_tiny_graphs(
    partition: dict[torch.fx.Node, int],
    reasons: dict[int, BreakReason],
    layer_ids: dict[int, tuple[int, ...]],
    most: int,
) -> int:
    """Folds each graph partition between two breaks that launches at most ``most`` kernels into one
    break with both neighbours (a graph launch and the bridges around it cost more than running those
    few ops eagerly). Rewrites the three maps in place; returns how many partitions were folded."""
    members: dict[int, list[torch.fx.Node]] = {}
    for node, part in partition.items():
        members.setdefault(part, []).append(node)
    order = sorted(members)
    folded, merged_into = 0, {p: p for p in order}
    for before, graph, after in zip(order, order[1:], order[2:]):
        if graph in reasons or merged_into[before] not in reasons or after not in reasons:
            continue
        ops = [n for n in members[graph] if _launches(n)]
        if len(ops) > most:
            continue
        head = merged_into[before]
        first, second = reasons[head], reasons.pop(after)
        calls = (n for n in members[graph] if n.op.startswith("call_"))
        names = ", ".join(dict.fromkeys(op_name(n, qualified=True) for n in calls))
        reasons[head] = dataclasses.replace(first, detail=(
            f"{first.detail}; joined with the next break ({second.kind.value}: {second.op}) across "
            f"{len(ops)} cheap op{'s' * (len(ops) != 1)} ({names or 'views'}) run eagerly"))
        layer_ids[head] = layer_ids.get(head, ()) + layer_ids.pop(after, ())
        for node in members[graph] + members[after]:
            partition[node] = head
        merged_into[graph] = merged_into[after] = head
        folded += 1
    return folded

"""Pass ``inline_nested_regions``: copy each ``torch.compiler.nested_compile_region`` call into the graph.

Dynamo traces a function marked with ``torch.compiler.nested_compile_region`` once and emits every
later call of it as an ``invoke_subgraph`` of the same subgraph (hierarchical compilation): a stage of
N identical layers whose attention-free parts are marked is traced in about the time of one layer, not
N. The other passes reason about single ops (token dims, padding safety, where to break), so this pass
puts each call's ops back into the stage graph, wired to that call's operands (its own layer's
weights). The subgraph's traced values come along, so every later pass sees what a flat trace gives.
Regions inside regions are inlined too. Each copy's module stack (``meta["nn_module_stack"]``) names
its own call's module, not the module of the call the subgraph was traced for, so passes that name
regions by module path (``find_declared_regions``) tell the layers apart. The copies that
``ppcompile.trace_layers_once`` puts around a region (``ppcompile::region_copy`` on its inputs and
outputs, ``ppcompile::region_write_back`` after it: a region may not alias) are dropped, so the graph
aliases and writes in place as the model does.

Before::

    subgraph_0 = self.subgraph_0
    invoke_subgraph = torch.ops.higher_order.invoke_subgraph(subgraph_0, 'subgraph_0', l_hidden_, l_w2_)
    getitem = invoke_subgraph[0]
    invoke_subgraph_1 = torch.ops.higher_order.invoke_subgraph(subgraph_0, 'subgraph_0', getitem, l_w3_)
    getitem_1 = invoke_subgraph_1[0]

After::

    linear = torch._C._nn.linear(l_hidden_, l_w2_);  relu = torch.relu(linear)
    linear_1 = torch._C._nn.linear(relu, l_w3_);  relu_1 = torch.relu(linear_1)

``ctx.region_traces`` records, per subgraph, how many calls it served (here ``{"subgraph_0": 2}``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ppcompile.analysis.copied_calls import copy_node, innermost_module, replace_call, restacked
from ppcompile.passes.context import PassContext, PassResult
from ppcompile.tracing.marker_ops import region_copy, region_write_back

__all__ = ["inline_nested_regions"]

log = logging.getLogger(__name__)

_REGION_COPY = region_copy._opoverload
_REGION_WRITE_BACK = region_write_back._opoverload


def _invoke_subgraph() -> Any:
    return getattr(torch.ops.higher_order, "invoke_subgraph", None)


def _subgraph_of(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.GraphModule:
    ref = node.args[0]
    is_attr = isinstance(ref, torch.fx.Node) and ref.op == "get_attr"
    sub = getattr(gm, str(ref.target), None) if is_attr else None  # type: ignore[union-attr]
    if not isinstance(sub, torch.fx.GraphModule):
        raise ValueError(
            f"pp_breakable: {node.name} calls invoke_subgraph with {ref!r}, not a subgraph of the stage "
            "graph; this torch's nested_compile_region emits a form ppcompile does not read"
        )
    return sub


def _lift_attr(gm: torch.fx.GraphModule, value: Any, lifted: dict[int, str]) -> str:
    """The stage graph's attribute name for a subgraph's constant (or inner subgraph) ``value``."""
    name = lifted.get(id(value))
    if name is None:
        name = f"_pp_region_attr_{len(lifted)}"
        while hasattr(gm, name):
            name += "_"
        if isinstance(value, torch.nn.Module):
            gm.add_submodule(name, value)
        elif isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
            gm.register_buffer(name, value)  # as a GraphModule holds a tensor its graph reads
        else:
            setattr(gm, name, value)
        lifted[id(value)] = name
    return name


def _inline_call(
    gm: torch.fx.GraphModule, node: torch.fx.Node, sub: torch.fx.GraphModule, lifted: dict[int, str],
    traced_at: str | None,
) -> None:
    graph = gm.graph
    call_stack = node.meta.get("nn_module_stack")
    env: dict[torch.fx.Node, Any] = {}
    placeholders = list(sub.graph.find_nodes(op="placeholder"))
    operands = node.args[2:]  # (subgraph, identifier, *operands); older torch: one operands tuple
    if len(operands) == 1 and isinstance(operands[0], (tuple, list)) and len(placeholders) != 1:
        operands = tuple(operands[0])
    if len(placeholders) != len(operands):
        raise ValueError(f"pp_breakable: {node.name} passes {len(operands)} operands to a subgraph with "
                         f"{len(placeholders)} inputs")
    env.update(zip(placeholders, operands))
    results: Any = None
    stacks: dict[Any, dict[str, Any]] = {}
    with graph.inserting_before(node):
        for sn in sub.graph.nodes:
            if sn.op == "placeholder":
                continue
            if sn.op == "output":
                results = sn.args[0]
                continue
            if sn.op == "get_attr":  # a constant (or inner region) of the subgraph: lift it
                value = sub
                for part in str(sn.target).split("."):
                    value = getattr(value, part)
                copied = graph.get_attr(_lift_attr(gm, value, lifted))
                copied.meta = dict(restacked(sn.meta, traced_at, call_stack, stacks))  # its own, not sn's
                env[sn] = copied
                continue
            if sn.op == "call_function" and sn.target is _REGION_COPY:  # a copy for Dynamo only
                env[sn] = env[sn.args[0]]
                continue
            env[sn] = copy_node(graph, sn, env.__getitem__, restacked(sn.meta, traced_at, call_stack, stacks))
    replace_call(graph, node, [env[r] if isinstance(r, torch.fx.Node) else r for r in results],
                 "inlines regions")


def inline_nested_regions(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Replaces every ``invoke_subgraph`` call with a copy of its subgraph's ops."""
    hop = _invoke_subgraph()
    if hop is None:
        return PassResult(gm, modified=False)
    calls: dict[str, int] = {}
    traced_at: dict[int, str | None] = {}  # subgraph -> the module path of its first call
    lifted: dict[int, str] = {}
    while True:  # an inlined region may hold calls of inner regions: inline until none is left
        pending = list(gm.graph.find_nodes(op="call_function", target=hop))
        if not pending:
            break
        for node in pending:
            sub = _subgraph_of(gm, node)
            origin = traced_at.setdefault(id(sub), innermost_module(node))
            _inline_call(gm, node, sub, lifted, origin)
            name = str(node.args[1])
            calls[name] = calls.get(name, 0) + 1
    strays = [*gm.graph.find_nodes(op="call_function", target=_REGION_COPY),
              *gm.graph.find_nodes(op="call_function", target=_REGION_WRITE_BACK)]
    for stray in strays:  # copies of a call traced flat, and their write-backs
        if stray.target is _REGION_COPY:
            stray.replace_all_uses_with(stray.args[0])
        gm.graph.erase_node(stray)
    ctx.region_traces = calls
    if not calls:
        if strays:
            gm.recompile()
        return PassResult(gm, modified=bool(strays))
    for ref in list(gm.graph.find_nodes(op="get_attr")):
        if not ref.users:
            gm.graph.erase_node(ref)
    used = {str(n.target) for n in gm.graph.find_nodes(op="get_attr")}
    for name, child in list(gm.named_children()):
        if isinstance(child, torch.fx.GraphModule) and name not in used:
            delattr(gm, name)
    gm.graph.lint()
    gm.recompile()
    log.debug("%s: inlined %d nested compile region call(s) of %d subgraph(s)", ctx.graph_name,
              sum(calls.values()), len(calls))
    return PassResult(gm, modified=True)

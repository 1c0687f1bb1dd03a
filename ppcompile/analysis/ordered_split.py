"""``split_at_breaks``'s split: ``torch.fx.passes.split_module(gm, gm, partition_of,
keep_original_order=True)`` for partitions that follow the graph's order, built in one walk.

``split_module`` serves any partition: it sorts partitions by their dependencies, works out each
value's symbols at every use across partitions, and looks each input up in the list of all graph
inputs per partition. For a stage graph of thousands of nodes and hundreds of graph inputs (stamped
layers' weights) that is about half of its time. Here each partition is one run of consecutive nodes, so
one walk records the values each partition reads and hands on, and each value's symbols are worked
out once. The result is the same module: the same submodules with the same code, the same calls and
``getitem`` unpacking, the same node meta. Graphs that need more of ``split_module`` (partitions out of
order, submodule calls or module attributes, grad-mode or autocast switches, which it carries into
every partition they span) get ``None``, and the caller uses ``split_module``.

For ``linear -> attention -> relu`` in partitions ``0, 1, 2``::

    def forward(self, L_x_, L_w_):
        submod_0 = self.submod_0(L_x_, L_w_)
        submod_1 = self.submod_1(submod_0)
        submod_2 = self.submod_2(submod_1)
        return (submod_2,)
"""

from __future__ import annotations

import inspect
import itertools
import operator
from collections.abc import Mapping

import sympy
import torch
from torch.fx.node import map_arg

from ppcompile.analysis.copied_calls import copy_node
from ppcompile.torch_internals.tracing import free_symbols, global_state_ops, lazy_graph_module

__all__ = ["split_in_order"]

Node = torch.fx.Node


def split_in_order(gm: torch.fx.GraphModule, partition: Mapping[Node, int]) -> torch.fx.GraphModule | None:
    """``gm`` split into ``submod_<i>`` modules, one per partition index of ``partition`` (every node
    but placeholders, module attributes and the output), as ``split_module`` splits it; None where this
    split does not apply (see the module docstring)."""
    calls = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    if not _applies(gm, calls, partition):
        return None
    partition = {n: partition[n] for n in calls}  # module attributes are read like graph inputs
    bound = _symbol_bindings(gm)
    order = list(dict.fromkeys(partition.values()))
    inputs: dict[int, dict[Node, None]] = {p: {} for p in order}
    outputs: dict[int, dict[Node, None]] = {p: {} for p in order}
    symbols: dict[Node, list[Node]] = {}

    def use(value: Node, user: int | None) -> None:
        defined = partition.get(value)
        if defined == user:
            return
        if defined is not None:
            outputs[defined].setdefault(value)
        if user is None:
            return
        inputs[user].setdefault(value)
        if value not in symbols:  # a value's size symbols travel with it: the reader's shapes need them
            found = free_symbols(value.meta.get("example_value"))
            symbols[value] = [bound[s] for s in sorted(found, key=str)]
        for binder in symbols[value]:
            inputs[user].setdefault(binder)
            if (where := partition.get(binder)) is not None:
                outputs[where].setdefault(binder)

    for node in gm.graph.nodes:
        if node.op == "output":
            map_arg(node.args[0], lambda v: use(v, None))
        elif node in partition:
            map_arg((node.args, node.kwargs), lambda v, p=partition[node]: use(v, p))  # type: ignore[misc]

    graphs = {p: _partition_graph(inputs[p]) for p in order}
    for node in calls:
        graph, env = graphs[partition[node]]
        env[node] = copy_node(graph, node, env.__getitem__, node.meta, keep_name=False)
    return _stitch(gm, order, graphs, inputs, outputs)


def _applies(gm: torch.fx.GraphModule, calls: list[Node], partition: Mapping[Node, int]) -> bool:
    switches = global_state_ops()
    if any(n.op == "call_module" or n.target in switches for n in calls):
        return False
    if any("." in str(n.target) or isinstance(getattr(gm, str(n.target)), torch.nn.Module)
           for n in gm.graph.find_nodes(op="get_attr")):
        return False
    indices = [partition[n] for n in calls]
    return all(a <= b for a, b in itertools.pairwise(indices))


def _symbol_bindings(gm: torch.fx.GraphModule) -> dict[sympy.Symbol, Node]:
    """Each symbol's first node whose value is exactly that symbol (graph inputs come first)."""
    bound: dict[sympy.Symbol, Node] = {}
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if isinstance(value, (torch.SymInt, torch.SymFloat)) and isinstance(value.node.expr, sympy.Symbol):
            bound.setdefault(value.node.expr, node)
    return bound


def _partition_graph(reads: dict[Node, None]) -> tuple[torch.fx.Graph, dict[Node, Node]]:
    graph = torch.fx.Graph()
    env: dict[Node, Node] = {}
    for value in reads:
        placeholder = graph.placeholder(value.name, type_expr=value.type)
        placeholder.meta = value.meta.copy()
        env[value] = placeholder
    return graph, env


def _stitch(
    gm: torch.fx.GraphModule, order: list[int], graphs: dict[int, tuple[torch.fx.Graph, dict[Node, Node]]],
    inputs: dict[int, dict[Node, None]], outputs: dict[int, dict[Node, None]],
) -> torch.fx.GraphModule:
    """The split module: the graph inputs, then each partition's call in order, unpacked by index."""
    base = torch.fx.Graph()
    root = torch.nn.Module()
    env: dict[Node, Node] = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        default = node.args[0] if node.args else inspect.Signature.empty
        env[node] = base.placeholder(str(node.target), type_expr=node.type, default_value=default)
        env[node].meta = node.meta.copy()
    for p in order:
        graph, inner = graphs[p]
        handed = tuple(inner[v] for v in outputs[p])
        graph.output(handed[0] if len(handed) == 1 else handed)
        for value in inputs[p]:
            if value.op == "get_attr" and value not in env:
                env[value] = base.get_attr(str(value.target))
                env[value].meta = value.meta.copy()
                setattr(root, str(value.target), getattr(gm, str(value.target)))
        name = f"submod_{p}"
        setattr(root, name, lazy_graph_module(torch.nn.Module(), graph))
        call = base.call_module(name, tuple(env[v] for v in inputs[p]))
        if len(outputs[p]) == 1:
            env[next(iter(outputs[p]))] = call
        else:
            for i, value in enumerate(outputs[p]):
                env[value] = base.call_function(operator.getitem, (call, i))
    output = next(iter(gm.graph.find_nodes(op="output")))
    base.output(map_arg(output.args[0], env.__getitem__))
    return lazy_graph_module(root, base)

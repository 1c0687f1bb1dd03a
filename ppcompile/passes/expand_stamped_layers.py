"""Pass ``expand_stamped_layers``: copy the exemplar's ops for each stamped layer (``layer_stamps``).

A layer that ``trace_layers_once(stage)`` stamped reaches the stage graph as one
``ppcompile::stamped_layer`` call (whose fake kernel checked it); its exemplar
(the first layer of its group called) was traced op by op between ``ppcompile::layer_input`` and
``ppcompile::layer_output`` markers. Each call becomes a copy of the exemplar's ops, wired to the call's
inputs; the exemplar's weights become the layer's own (new graph inputs, in ``ctx.bound_inputs``, which
the runtime appends to each call's inputs); the custom-op constants the check found different (a
global layer id) become the layer's; each copy's module stack names the layer. The markers, the
exemplar's write-backs and the calls of layers whose check failed (traced flat after the call, which
nothing reads) go: the graph aliases and writes in place as the model does.

Before::

    copy = ppcompile.layer_input(l_x_, 'g0/layers.0', 0)
    linear = torch._C._nn.linear(copy, l_layers_0_up_weight);  tagged = test.tagged(linear, 0)
    region_write_back(l_x_, copy)
    x = ppcompile.layer_output(tagged, 'g0/layers.0', 0)
    stamped = ppcompile.stamped_layer([x], 'g0/layers.1', 'T');  x_1 = stamped[0]

After::

    linear = torch._C._nn.linear(l_x_, l_layers_0_up_weight);  tagged = test.tagged(linear, 0)
    linear_1 = torch._C._nn.linear(tagged, bound_layers_1_up_weight);  tagged_1 = test.tagged(linear_1, 1)

with ``bound_layers_1_up_weight`` a new graph input (``BOUND_WEIGHT``: ``layers.1.up.weight``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ppcompile.analysis.copied_calls import copy_node, innermost_module, replace_call, restacked
from ppcompile.analysis.node_facts import BOUND_WEIGHT
from ppcompile.passes.context import PassContext, PassResult
from ppcompile.torch_internals import OpOverload, OpOverloadPacket
from ppcompile.torch_internals.tracing import lazy_graph_module
from ppcompile.tracing.layer_stamp_checks import Substitution, named_state
from ppcompile.tracing.layer_stamps import (
    StampFacts,
    layer_input,
    layer_name,
    layer_of,
    layer_output,
    stamp_facts,
    stamped_layer,
)
from ppcompile.tracing.marker_ops import region_write_back

__all__ = ["expand_stamped_layers"]

log = logging.getLogger(__name__)

_INPUT, _OUTPUT = layer_input._opoverload, layer_output._opoverload
_STAMPED = stamped_layer._opoverload
_MARKERS = (_INPUT, _OUTPUT)
_WRITE_BACK = region_write_back._opoverload


class _Template:
    """The exemplar's ops, in graph order, what they read from outside, and its weights by identity."""

    def __init__(self, gm: torch.fx.GraphModule, handle: str) -> None:
        nodes = list(gm.graph.nodes)
        marks = [i for i, n in enumerate(nodes) if n.target in _MARKERS and n.args[1] == handle]
        self.nodes = nodes[marks[0]:marks[-1] + 1]
        inside = set(self.nodes)
        self.inputs = {int(n.args[2]): n for n in self.nodes if n.target is _INPUT}
        self.outputs = {int(n.args[2]): n.args[0] for n in self.nodes if n.target is _OUTPUT}
        self.path = innermost_module(self.nodes[0])  # a marker's module stack ends at the exemplar
        self.weights = {id(t): name for name, t in named_state(layer_of(handle)).items()}
        self.outside = list(dict.fromkeys(  # in graph order: the bound inputs' order is deterministic
            a for n in self.nodes if n.target is not _INPUT for a in n.all_input_nodes if a not in inside))


def expand_stamped_layers(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Replaces every ``stamped_layer`` call with a copy of its exemplar's ops."""
    stamped = list(gm.graph.find_nodes(op="call_function", target=_STAMPED))
    markers = [n for t in _MARKERS for n in gm.graph.find_nodes(op="call_function", target=t)]
    if not stamped and not markers:
        return PassResult(gm, modified=False)
    facts, refused = stamp_facts()
    checked = {str(n.args[1]) for n in stamped}
    ctx.traced_flat = {layer_name(h): why for h, why in refused.items() if h in checked}
    gm = lazy_graph_module(gm, gm.graph.__deepcopy__())  # new inputs: not in the graph Dynamo keeps
    stamped = []
    for node in list(gm.graph.find_nodes(op="call_function", target=_STAMPED)):
        if str(node.args[1]) in refused and not node.users:  # traced flat after it
            gm.graph.erase_node(node)
        else:
            stamped.append(node)
    input_copies = set(gm.graph.find_nodes(op="call_function", target=_INPUT))
    templates: dict[str, _Template] = {}
    index_of = {n: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    first_op = next(n for n in gm.graph.nodes if n.op != "placeholder")  # bound inputs go before it
    for node in stamped:
        handle = str(node.args[1])
        if handle not in facts:
            raise ValueError(f"pp_breakable: {node.name} stamps layer {handle!r}, which this trace did not "
                             "check: stamped layers compile only inside the Dynamo trace that stamped them "
                             "(not from a stored graph or an ahead-of-time compile)")
        fact = facts[handle]
        template = templates.get(fact.exemplar) or templates.setdefault(fact.exemplar,
                                                                         _Template(gm, fact.exemplar))
        _expand(gm, ctx, node, handle, fact, template, index_of, first_op)
    for node in list(gm.graph.find_nodes(op="call_function", target=_WRITE_BACK)):
        if node.args[1] in input_copies:  # the exemplar's input copies go, and writing them back too
            gm.graph.erase_node(node)
    for node in [*gm.graph.find_nodes(op="call_function", target=_INPUT),
                 *gm.graph.find_nodes(op="call_function", target=_OUTPUT)]:
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    ctx.stamped_layers = len(stamped)
    log.debug("%s: stamped %d layer(s) from %d exemplar(s)", ctx.graph_name, len(stamped), len(templates))
    return PassResult(gm, modified=True)


def _expand(
    gm: torch.fx.GraphModule, ctx: PassContext, node: torch.fx.Node, handle: str, fact: StampFacts,
    template: _Template, index_of: dict[torch.fx.Node, int], first_op: torch.fx.Node,
) -> None:
    graph = gm.graph
    state = named_state(layer_of(handle))
    operands = list(node.args[0])  # type: ignore[arg-type]
    env: dict[torch.fx.Node, Any] = {template.inputs[i]: operands[i] for i in template.inputs}
    for outer in template.outside:
        if outer in env:
            continue
        if outer.op != "placeholder" and isinstance(outer.meta.get("example_value"), torch.SymInt):
            env[outer] = outer  # a size Dynamo computed once and reuses: valid anywhere after it
            continue
        if outer.op != "placeholder":
            readers = [n.format_node() for n in template.nodes if outer in n.all_input_nodes][:2]
            raise ValueError(f"pp_breakable: the exemplar of {handle!r} reads {outer.format_node()}, a value "
                             f"from outside it other than its inputs and weights ({readers}); it cannot be "
                             "stamped")
        name = template.weights.get(id(ctx.example_inputs[index_of[outer]]))
        env[outer] = outer if name is None else _bind(gm, ctx, outer, name, state[name], handle,
                                                           first_op)
    pending = _pending(fact.substitutions)
    call_stack = node.meta.get("nn_module_stack")  # ends at the stamped layer
    seen: dict[str, int] = {}
    stacks: dict[Any, dict[str, Any]] = {}
    with graph.inserting_before(node):
        for sn in template.nodes:
            if sn.target is _INPUT or sn.target is _WRITE_BACK:  # the write-back: of the exemplar's copy
                continue
            if sn.target is _OUTPUT:
                env[sn] = env[sn.args[0]]
                continue
            meta = restacked(sn.meta, template.path, call_stack, stacks)
            copy = copy_node(graph, sn, lambda n: env.get(n, n), meta)
            if (op := _custom_op_name(sn)) is not None:
                occurrence = seen[op] = seen.get(op, -1) + 1
                for sub in pending.get((op, occurrence), ()):
                    _substitute(copy, sub, handle)
            env[sn] = copy
    replace_call(graph, node, [env[template.outputs[i]] for i in sorted(template.outputs)],
                 "stamps layers")


def _bind(gm: torch.fx.GraphModule, ctx: PassContext, like: torch.fx.Node, name: str, value: torch.Tensor,
          handle: str, first_op: torch.fx.Node) -> torch.fx.Node:
    """A new graph input for weight ``name`` of layer ``handle`` (its value bound by the runtime), after
    the others: before ``first_op``, the graph's first node that is no input."""
    safe = "".join(c if c.isalnum() else "_" for c in f"bound_{layer_name(handle)}_{name}")
    with gm.graph.inserting_before(first_op):
        node = gm.graph.placeholder(safe)
    node.meta = {k: v for k, v in like.meta.items() if k in ("example_value", "val", "tensor_meta")}
    BOUND_WEIGHT.set(node, f"{layer_name(handle)}.{name}")
    ctx.example_inputs.append(value)
    ctx.bound_inputs.append(value)
    return node


def _pending(subs: tuple[Substitution, ...]) -> dict[tuple[str, int], list[Substitution]]:
    out: dict[tuple[str, int], list[Substitution]] = {}
    for sub in subs:
        out.setdefault((sub.op, sub.occurrence), []).append(sub)
    return out


def _custom_op_name(node: torch.fx.Node) -> str | None:
    target = node.target
    if node.op != "call_function":
        return None
    if isinstance(target, OpOverload):
        return str(target.name())
    if isinstance(target, OpOverloadPacket):
        return str(target.default.name())
    return None


def _substitute(copy: torch.fx.Node, sub: Substitution, handle: str) -> None:
    args = list(copy.args)
    if sub.index < len(args) and args[sub.index] == sub.old:
        args[sub.index] = sub.new
        copy.args = tuple(args)
        return
    if copy.kwargs.get(sub.name, object()) == sub.old:
        copy.kwargs = {**copy.kwargs, sub.name: sub.new}
        return
    raise ValueError(f"pp_breakable: cannot set {sub.name}={sub.new!r} in the copy of {sub.op} for "
                     f"stamped layer {handle!r}: the exemplar's call does not pass {sub.old!r} there")

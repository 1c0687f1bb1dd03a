"""Matching FX nodes against ops, as ``OpOverload`` and as ``OpOverloadPacket``, never by name alone; and
naming a node's op (:func:`op_name`) for rules keyed by name and for messages."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ppcompile.capturable import Rows, capturable_break, capturable_breaks
from ppcompile.engine_ops import EngineOp, OpRole, engine_op, layer_from_name, names_with_role
from ppcompile.torch_internals import (
    C_SCALED_DOT_PRODUCT_ATTENTION,
    OpOverload,
    OpOverloadPacket,
    qualified_op_name,
)
from ppcompile.torch_internals.ops import op_schema

__all__ = [
    "ATTENTION_LAYER_ARGS",
    "OpMatcher",
    "always_split_ops",
    "argument_of",
    "engine_entry",
    "loaded_ops",
    "op_name",
    "register_attention_op",
    "request_metadata_inputs",
    "resolve_op",
]

# Attention ops that take a global layer id, and the name of that argument. Strings resolve lazily, so
# the namespace of an op only needs to be loaded by the time a stage is compiled.
ATTENTION_LAYER_ARGS: dict[str, str] = {"ppcompile::attention": "layer_id",
                                         "ppcompile::attention_with_output": "layer_id"}

_SDPA_TARGETS: tuple[Any, ...] = (
    torch.nn.functional.scaled_dot_product_attention,
    C_SCALED_DOT_PRODUCT_ATTENTION,
    torch.ops.aten.scaled_dot_product_attention,
    torch.ops.aten._scaled_dot_product_flash_attention,
    torch.ops.aten._scaled_dot_product_efficient_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
)


def register_attention_op(op: str | Any, layer_id_arg: str = "layer_id") -> None:
    """Makes ``op`` an attention break whose argument ``layer_id_arg`` is its global layer id."""
    ATTENTION_LAYER_ARGS[op if isinstance(op, str) else _qualname(resolve_op(op))] = layer_id_arg


def resolve_op(op: str | Any) -> Any:
    """``"ns::name"`` -> ``torch.ops.ns.name`` (a packet); ops and callables pass through."""
    if not isinstance(op, str):
        return op
    ns, _, name = op.partition("::")
    try:
        return getattr(getattr(torch.ops, ns), name)
    except (AttributeError, RuntimeError) as e:
        raise ValueError(
            f"pp_breakable: split op {op!r} is not a registered torch op; import the module that "
            f"defines it before compiling (torch.ops.{ns} has no {name!r})"
        ) from e


def _qualname(op: Any) -> str:
    return qualified_op_name(op) or str(getattr(op, "__qualname__", op))


def op_name(node: torch.fx.Node, *, qualified: bool = False) -> str:
    """A node's op by name: a method's name (``mean``), a function's ``__name__`` (``linear``,
    ``attention.default``). ``qualified`` names torch ops with their namespace instead
    (``ppcompile.attention.default``, ``pptest.mix``), as break reasons do."""
    target = node.target
    if node.op == "call_method":
        return str(target)
    if qualified and isinstance(target, (OpOverload, OpOverloadPacket)):
        return str(target)
    return getattr(target, "__name__", str(target))


def loaded_ops(names: Iterable[str]) -> list[Any]:
    """The ops of ``names`` (``"ns::name"``) registered in this process; the others are skipped (not
    loaded here: no graph can contain them)."""
    ops: list[Any] = []
    for name in names:
        try:
            ops.append(resolve_op(name))
        except ValueError:
            continue
    return ops


def always_split_ops() -> list[Any]:
    """Ops that are breaks in every stage: the registered attention ops, SDPA, and the known engine ops
    that are attention or write state through a context (``engine_ops``)."""
    engine = names_with_role(OpRole.ATTENTION) + names_with_role(OpRole.STATE_WRITE)
    return [*_SDPA_TARGETS, *loaded_ops([*ATTENTION_LAYER_ARGS, *engine])]


def engine_entry(node: torch.fx.Node) -> EngineOp | None:
    """The entry of the known engine op ``node`` calls (``engine_ops.ENGINE_OPS``), or None."""
    if node.op != "call_function":
        return None
    qualname = qualified_op_name(node.target)
    return None if qualname is None else engine_op(qualname)


class OpMatcher:
    """Matches a node whose target is one of ``ops``: a packet matches all its overloads."""

    def __init__(self, ops: Iterable[Any]) -> None:
        self._targets: set[Any] = set()
        for op in ops:
            op = resolve_op(op)
            self._targets.add(op)
            if isinstance(op, OpOverload):
                self._targets.add(op.overloadpacket)
            elif isinstance(op, OpOverloadPacket):
                self._targets.update(getattr(op, o) for o in op.overloads())

    def matches(self, node: torch.fx.Node) -> bool:
        if node.op != "call_function":
            return False
        target = node.target
        if target in self._targets:
            return True
        return isinstance(target, OpOverload) and target.overloadpacket in self._targets


def attention_layer_id(
    node: torch.fx.Node, input_values: Mapping[torch.fx.Node, Any] | None = None
) -> int | None:
    """The global layer id a call to a registered attention op (or a known engine's) passes: an int
    argument, or the one integer of a layer-name argument, given as a constant or as a graph input whose
    traced value ``input_values`` holds; None otherwise."""
    target = node.target
    if (qualname := qualified_op_name(target)) is None:
        return None
    arg_name = ATTENTION_LAYER_ARGS.get(qualname)
    if arg_name is None:
        entry = engine_op(qualname)
        arg_name = entry.layer_arg if entry is not None and entry.role is OpRole.ATTENTION else None
    if arg_name is None:
        return None
    value = argument_of(node, arg_name)
    if isinstance(value, torch.fx.Node) and input_values is not None:
        value = input_values.get(value)  # a graph input (vLLM's layer-name object): its traced value
    return layer_from_name(value)


def argument_of(node: torch.fx.Node, name: str) -> Any:
    """The value a call of a torch op passes for its schema argument ``name`` (positional or keyword;
    None when not passed)."""
    if name in node.kwargs:
        return node.kwargs[name]
    names = [a.name for a in op_schema(node.target).arguments]
    k = names.index(name) if name in names else len(node.args)
    return node.args[k] if k < len(node.args) else None


def request_metadata_inputs(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The placeholders ``gm`` passes straight to a declared capturable op as metadata whose rows are not
    tokens (request starts, lengths, block tables; ``ppcompile.capturable``): no dim of theirs is the
    token count, whatever sizes a call gave them."""
    found: set[torch.fx.Node] = set()
    if not capturable_breaks():  # nothing declared: no walk over the graph
        return found
    for node in gm.graph.nodes:
        name = qualified_op_name(node.target) if node.op == "call_function" else None
        entry = capturable_break(name) if name else None
        if entry is None:
            continue
        for arg, meta in entry.metadata.items():
            value = argument_of(node, arg)
            is_input = isinstance(value, torch.fx.Node) and value.op == "placeholder"
            if is_input and meta.rows is not Rows.TOKENS:
                found.add(value)
    return found

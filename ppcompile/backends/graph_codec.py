"""A Dynamo stage graph to bytes and back, with the node metadata ppcompile's passes read.

Dynamo's graph carries fake values over its shape env, module stacks, stack traces, annotations and each
input's source. Pickled as they are, they drag the whole trace along (its shape env, weak references);
so each node is written as its op, name, target (an operator by its name under ``torch.ops``),
arguments (other nodes by name) and type, and its metadata as plain data: a fake tensor as its sizes,
strides and offset (integers or sympy expressions of the trace's symbols), dtype, device and whether it
is an inference tensor (Inductor's and AOTAutograd's cache keys read all of these, and the node types);
a fake opaque object of a value type (an engine's layer name lifted to an input) as the value it stood
for; an input's source as its name. Reading it back rebuilds fake values in a fresh shape env with the traced
symbols, their hints and the trace's shape guards, so the passes see what they saw in the first process.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import sympy
import torch

from ppcompile.torch_internals import current_shape_env
from ppcompile.torch_internals.frames import outside_the_call
from ppcompile.torch_internals.precompile import (
    fake_opaque,
    fake_tensor,
    new_fake_mode,
    opaque_value,
    operator_name,
    operator_named,
    shape_env_state,
    symbolic_value,
    traced_sources,
)

__all__ = ["GraphCodecError", "InputSource", "dumps_stage_graph", "graph_from_records", "graph_records",
           "loads_stage_graph", "restore_input_sources"]

_KEPT = ("nn_module_stack", "stack_trace", "custom")  # plain data, as Dynamo wrote them
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)


class GraphCodecError(ValueError):
    """The stage graph holds a value the codec cannot write (the stage then compiles as usual)."""


@dataclasses.dataclass(frozen=True)
class _Source:
    name: str
    outside_call: bool = False  # torch_internals.frames.outside_the_call of the traced source


@dataclasses.dataclass(frozen=True)
class InputSource:
    """What the passes read of Dynamo's ``meta["grapharg"]``: the input's source and whether a Python
    scalar was passed as a tensor."""

    source: _Source | None
    pass_arg_as_tensor: bool


@dataclasses.dataclass(frozen=True)
class _Sym:
    kind: type
    expr: sympy.Basic


@dataclasses.dataclass(frozen=True)
class _Shape:
    """A ``torch.Size`` (a ``.shape`` node's value), whose items may be symbolic."""

    items: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class _Opaque:
    """A fake opaque object of a value type, as the real value it stood for when traced."""

    value: Any


@dataclasses.dataclass(frozen=True)
class _Tensor:
    size: tuple[Any, ...]
    stride: tuple[Any, ...]
    offset: Any
    dtype: torch.dtype
    device: str
    parameter: bool
    requires_grad: bool
    inference: bool


def _size(x: Any) -> Any:
    return _Sym(type(x), x.node.expr) if isinstance(x, _SYMBOLIC) else x


def _encode(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _Tensor(tuple(_size(s) for s in value.shape), tuple(_size(s) for s in value.stride()),
                       _size(value.storage_offset()), value.dtype, str(value.device),
                       isinstance(value, torch.nn.Parameter), value.requires_grad, value.is_inference())
    if isinstance(value, _SYMBOLIC):
        return _size(value)
    if isinstance(value, torch.Size):
        return _Shape(tuple(_size(s) for s in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_encode(v) for v in value)
    if isinstance(value, _PLAIN):
        return value
    opaque = opaque_value(value)
    if opaque is not None:
        return _Opaque(opaque)
    raise GraphCodecError(f"a node's traced value is a {type(value).__name__}, which the codec cannot write")


class _Decoder:
    """Fake values in one fake mode; one SymInt per distinct expression."""

    def __init__(self, fake_mode: Any) -> None:
        self.fake_mode = fake_mode
        self._symbols: dict[_Sym, Any] = {}

    def __call__(self, value: Any) -> Any:
        if isinstance(value, _Sym):
            if value not in self._symbols:
                self._symbols[value] = symbolic_value(self.fake_mode, value.expr, value.kind)
            return self._symbols[value]
        if isinstance(value, _Tensor):
            with torch.inference_mode(value.inference):  # Inductor's and AOTAutograd's keys see it
                size, stride = [self(s) for s in value.size], [self(s) for s in value.stride]
                t = fake_tensor(self.fake_mode, size, stride, self(value.offset), value.dtype, value.device)
                return torch.nn.Parameter(t, value.requires_grad) if value.parameter else t
        if isinstance(value, _Shape):
            return torch.Size(self(s) for s in value.items)
        if isinstance(value, _Opaque):
            return fake_opaque(self.fake_mode, value.value)
        if isinstance(value, (tuple, list)):
            return type(value)(self(v) for v in value)
        return value


def _input_source(grapharg: Any) -> InputSource:
    source = getattr(grapharg, "source", None)
    return InputSource(None if source is None else _Source(str(source.name), outside_the_call(source)),
                       bool(getattr(grapharg, "pass_arg_as_tensor", False)))


def restore_input_sources(gm: torch.fx.GraphModule) -> int:
    """Puts back the input sources of a graph Dynamo's ahead-of-time compile hands the backend: its trace
    dropped each input's ``meta["grapharg"]`` before the call, and without a source the passes would take
    a buffer or an engine's kernel handle held outside the call for a live input (copied into a static
    buffer at every call). Each input whose traced value the trace recorded gets an :class:`InputSource`
    as :func:`dumps_stage_graph` writes it (a tensor, not a scalar passed as one); one with a grapharg, or
    not recorded, is left as it is. How many were put back (0 outside a trace)."""
    shape_env = current_shape_env()
    sources = traced_sources(shape_env) if shape_env is not None else {}
    restored = 0
    for node in gm.graph.find_nodes(op="placeholder"):
        source = sources.get(id(node.meta.get("example_value")))
        if "grapharg" not in node.meta and source is not None:
            node.meta["grapharg"] = InputSource(_Source(str(source.name), outside_the_call(source)), False)
            restored += 1
    return restored


@dataclasses.dataclass(frozen=True)
class _Ref:
    """An argument that is another node, by name."""

    name: str


@dataclasses.dataclass(frozen=True)
class _Operator:
    """A node target that is a torch operator, by its name under ``torch.ops``."""

    name: str


def _node_record(node: torch.fx.Node) -> tuple[Any, ...]:
    op_name = operator_name(node.target)
    target = _Operator(op_name) if op_name is not None else node.target
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: _Ref(n.name))  # type: ignore[arg-type,return-value]
    return node.op, node.name, target, args, kwargs, node.type


def graph_records(graph: torch.fx.Graph) -> list[tuple[Any, ...]]:
    """``graph``'s nodes as plain records (op, name, target, arguments by name, type), for
    :func:`graph_from_records`; node metadata is not written."""
    return [_node_record(node) for node in graph.nodes]


def graph_from_records(records: list[tuple[Any, ...]]) -> torch.fx.Graph:
    """The graph :func:`graph_records` wrote (nodes, names and types; no metadata)."""
    graph = torch.fx.Graph()
    nodes: dict[str, torch.fx.Node] = {}

    def arg(value: Any) -> Any:
        if isinstance(value, _Ref):
            return nodes[value.name]
        if isinstance(value, (tuple, list)):
            return type(value)(arg(v) for v in value)
        if isinstance(value, dict):
            return {k: arg(v) for k, v in value.items()}
        if isinstance(value, slice):
            return slice(arg(value.start), arg(value.stop), arg(value.step))
        return value

    for op, name, target, args, kwargs, type_expr in records:
        if isinstance(target, _Operator):
            target = operator_named(target.name)
        node = graph.create_node(op, target, arg(args), arg(kwargs), name=name, type_expr=type_expr)
        if node.name != name:
            raise GraphCodecError(f"node {name} was read back as {node.name}")
        nodes[name] = node
    return graph


def dumps_stage_graph(gm: torch.fx.GraphModule) -> bytes:
    """``gm`` (Dynamo's graph, during its trace) as bytes. Raises :class:`GraphCodecError` for a graph it
    cannot write."""
    shape_env = current_shape_env()
    if shape_env is None:
        raise GraphCodecError("no Dynamo trace is in progress: its shape env holds the graph's symbols")
    records, metas = [], []
    for node in gm.graph.nodes:
        meta = {k: node.meta[k] for k in _KEPT if k in node.meta}
        if "example_value" in node.meta:
            meta["example_value"] = _encode(node.meta["example_value"])
        if "grapharg" in node.meta:
            meta["grapharg"] = _input_source(node.meta["grapharg"])
        records.append(_node_record(node))
        metas.append(meta)
    attrs = {n.target: getattr(gm, str(n.target)) for n in gm.graph.nodes if n.op == "get_attr"}
    try:
        return pickle.dumps((records, metas, attrs, shape_env_state(shape_env)))
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise GraphCodecError(f"the stage graph does not pickle: {e}") from e


def loads_stage_graph(data: bytes) -> tuple[torch.fx.GraphModule, Any]:
    """The graph :func:`dumps_stage_graph` wrote, with its metadata, and the fake mode of its values."""
    records, metas, attrs, state = pickle.loads(data)
    graph = graph_from_records(records)
    fake_mode = new_fake_mode(state)
    decode = _Decoder(fake_mode)
    for node, meta in zip(graph.nodes, metas, strict=True):
        if "example_value" in meta:
            meta["example_value"] = decode(meta["example_value"])
        node.meta = meta
    return torch.fx.GraphModule(attrs, graph), fake_mode

"""The structural key of a graph segment: equal for segments that compile to the same artifact.

Dynamo passes parameters as graph inputs, so the segments of N identical decoder layers differ only in
placeholder names and in which weights they are handed. :func:`structural_key` prints a segment
canonically (its nodes by position, targets, constants, the dtype/shape/stride/device of every input
with symbols renamed in order of appearance, which inputs are module state, and the compiler options)
and hashes the text; ``segment_compilers.py`` shares one compiled artifact among segments with equal
keys. Node names never enter the key; an object only equal to itself (a baked tensor, a submodule, a
Python function the graph calls) enters by address and is pinned so that no other object takes the
address.

Before (two layers' middle segments)::

    def forward(self, out, L_w2_o_, L_w2_up_):      # layer 2       key 3f0c...
    def forward(self, out_1, L_w3_o_, L_w3_up_):    # layer 3       key 3f0c...  -> reused

After: both call sites hold the same compiled callable.
"""

from __future__ import annotations

import hashlib
import types
from collections.abc import Mapping, Sequence
from typing import Any

import sympy
import torch

from ppcompile.symbolic import example_value, size_expr
from ppcompile.torch_internals import OpOverload, OpOverloadPacket

__all__ = ["clear_pinned", "program_lines", "structural_key"]

_PINNED: dict[int, Any] = {}
"""Objects a key names by address (a baked tensor): kept alive so no other object takes the address."""
_VALUE_TYPES = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout,
                torch.memory_format)


def clear_pinned() -> None:
    """Lets go of the objects keys named by address (with the artifacts those keys shared)."""
    _PINNED.clear()


def _by_address(obj: Any) -> str:
    _PINNED[id(obj)] = obj
    return f"{type(obj).__qualname__}@{id(obj):x}"


class _Canon:
    """Renders a segment's inputs and constants as text with symbols renamed in order of appearance."""

    def __init__(self) -> None:
        self.symbols: dict[sympy.Symbol, sympy.Symbol] = {}

    def expr(self, e: sympy.Expr) -> str:
        for s in sorted(e.free_symbols, key=str):
            if s not in self.symbols:
                self.symbols[s] = sympy.Symbol(f"c{len(self.symbols)}", integer=True, positive=True)
        return str(e.xreplace(self.symbols))

    def value(self, v: Any) -> str:
        """An input's traced value: metadata only, never data."""
        if isinstance(v, torch.Tensor):
            shape = ",".join(self.expr(size_expr(s)) for s in v.shape)
            stride = ",".join(self.expr(size_expr(s)) for s in v.stride())
            return f"T({v.dtype},{v.device.type},[{shape}],[{stride}],{v.requires_grad})"
        if isinstance(v, torch.SymInt):
            return f"S({self.expr(size_expr(v))})"
        if isinstance(v, (torch.SymFloat, torch.SymBool)):
            return f"{type(v).__name__}({self.expr(v.node.expr)})"
        return f"C({_const(v)})"


def _const(v: Any) -> str:
    """A constant argument as text that is equal exactly when the constant is: a value typed (1, 1.0
    and True differ; so do 0.0 and -0.0, which print differently), containers by their items, any
    other object (a tensor, a function, an enum) by address."""
    if isinstance(v, _VALUE_TYPES):
        return f"{type(v).__name__}:{v!r}"
    if isinstance(v, (list, tuple)):
        return f"{type(v).__name__}[{','.join(_const(x) for x in v)}]"
    if isinstance(v, slice):
        return f"slice({_const(v.start)},{_const(v.stop)},{_const(v.step)})"
    if isinstance(v, dict):
        return "{" + ",".join(f"{_const(k)}:{_const(x)}" for k, x in v.items()) + "}"
    return _by_address(v)


def _function(t: Any) -> str:
    """A ``call_function`` target: an operator by name, a C function of a module or class by module and
    name (one object per name), any other callable by address (two closures of one function share
    their module and name, not their code's behaviour)."""
    if isinstance(t, (OpOverload, OpOverloadPacket)):
        return str(t)
    if isinstance(t, types.BuiltinFunctionType) and (t.__self__ is None
                                                      or isinstance(t.__self__, (types.ModuleType, type))):
        return f"{t.__module__}.{t.__qualname__}"
    return f"fn {_by_address(t)}"


def _target(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str:
    t = node.target
    if node.op == "call_function":
        return _function(t)
    if node.op == "get_attr":  # a tensor baked into the segment: shared only with the same tensor
        obj = gm
        for part in str(t).split("."):
            obj = getattr(obj, part)
        return f"attr {_by_address(obj)}"
    if node.op == "call_module":
        return f"module {_by_address(gm.get_submodule(str(t)))}"
    return str(t)


def program_lines(gm: torch.fx.GraphModule) -> list[str]:
    """``gm``'s graph as text, one line per node: its op, target and arguments, nodes by position
    (placeholders by position only), constants as :func:`_const` writes them. Node names never enter."""
    index: dict[torch.fx.Node, int] = {}

    def arg(a: Any) -> str:
        if isinstance(a, torch.fx.Node):
            return f"%{index[a]}"
        if isinstance(a, (list, tuple)):
            return f"{type(a).__name__}[{','.join(arg(x) for x in a)}]"
        if isinstance(a, dict):
            return "{" + ",".join(f"{k}:{arg(x)}" for k, x in a.items()) + "}"
        return _const(a)

    lines = []
    for node in gm.graph.nodes:
        index[node] = len(index)
        if node.op == "placeholder":
            lines.append("placeholder")
        else:
            kwargs = ",".join(f"{k}={arg(v)}" for k, v in node.kwargs.items())
            lines.append(f"{node.op} {_target(node, gm)} ({arg(node.args)}) {{{kwargs}}}")
    return lines


def structural_key(
    gm: torch.fx.GraphModule, input_kinds: Sequence[str], options: Mapping[str, Any]
) -> str:
    """The key under which ``gm`` shares a compiled artifact (16 hex digits).

    ``input_kinds`` names each placeholder's role (module state, live tensor, intermediate, ...);
    ``options`` are the compiler and its options. Node names never enter the key.
    """
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if len(input_kinds) != len(placeholders):
        raise ValueError(f"structural_key: {len(input_kinds)} input kinds for {len(placeholders)} inputs")
    canon = _Canon()
    lines = [f"options {sorted((k, _const(v)) for k, v in options.items())}"]
    lines += [f"in {kind} {canon.value(example_value(p))}" for p, kind in zip(placeholders, input_kinds)]
    return hashlib.sha256("\n".join(lines + program_lines(gm)).encode()).hexdigest()[:16]

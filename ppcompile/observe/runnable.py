"""A graph module as a runnable Python file: ``print_readable`` code plus a small harness.

The file defines ``GraphModule`` (nested submodules as nested classes, exactly as ``print_readable``
writes them), imports what the code names, and adds ``example_inputs(**sizes)`` (random tensors shaped
like the traced inputs; one keyword per symbolic size, defaulting to its traced value) and
``make_module()``. Run it with ``python FILE`` to execute the graph once on those inputs, or import it
and call ``make_module()(*example_inputs(s0=64))``. Ops that read engine state (attention reads a
forward context) need that state to run; the rest of a graph runs as is.
"""

from __future__ import annotations

import operator
from typing import Any

import sympy
import torch

from ppcompile.symbolic import example_value, size_expr, size_hints
from ppcompile.torch_internals import (
    OpOverload,
    OpOverloadPacket,
    custom_op_module,
)

__all__ = ["runnable_source"]

_BUILTIN_NAMESPACES = {"aten", "prims", "_c10d_functional", "c10d_functional", "higher_order", "profiler",
                       "_dynamo", "inductor", "quantized", "_quantized"}


def _graph_modules(gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    return [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]


def _op_imports(gm: torch.fx.GraphModule) -> list[str]:
    """``import`` lines for the Python modules that register the custom ops the graph calls."""
    lines: dict[str, str] = {}
    for sub in _graph_modules(gm):
        for node in sub.graph.nodes:
            target = node.target
            if node.op != "call_function":
                continue
            if isinstance(target, OpOverload):
                target = target.overloadpacket
            if not isinstance(target, OpOverloadPacket):
                continue
            qualname = target._qualified_op_name
            if qualname.split("::")[0] in _BUILTIN_NAMESPACES or qualname in lines:
                continue
            module = custom_op_module(qualname)
            lines[qualname] = (f"import {module}  # registers {qualname}" if module else
                               f"# {qualname}: import the module that registers this op before running")
    return sorted(set(lines.values()))


def _global_imports(gm: torch.fx.GraphModule) -> tuple[list[str], list[str]]:
    """``from m import q as name`` for every global the generated code names; and what cannot be found."""
    lines, missing = set(), set()
    for sub in _graph_modules(gm):
        globals_ = sub.graph.python_code(root_module="self").globals
        for name, obj in globals_.items():
            if name in ("torch", "inf", "nan", "device", "fx_pytree", "pytree") or obj is operator:
                continue
            module, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
            if module == "builtins":
                continue
            if module and qual and "<" not in qual and "." not in qual:
                lines.add(f"from {module} import {qual} as {name}" if qual != name else
                          f"from {module} import {qual}")
            elif module and qual and "<" not in qual:
                lines.add(f"import {module}\n{name} = {module}.{qual}")
            else:
                missing.add(name)
    return sorted(lines), sorted(missing)


class _Symbols:
    """Free symbols of the traced shapes and their traced values (defaults of ``example_inputs``)."""

    def __init__(self) -> None:
        self.hints: dict[sympy.Symbol, int] = {}

    def expr(self, size: int | torch.SymInt) -> sympy.Expr:
        for s, hint in size_hints(size).items():
            self.hints.setdefault(s, 8 if hint is None else hint)
        return size_expr(size)

    def code(self, size: int | torch.SymInt) -> str:
        """Python for a size: a literal, or a polynomial in the harness's size keywords."""
        expr = self.expr(size)
        if expr.is_Integer:
            return str(int(expr))
        syms = sorted(expr.free_symbols, key=str)
        if all(s.is_Symbol for s in syms) and expr.is_polynomial(*syms):
            poly = sympy.Poly(expr, *syms)
            if all(c.is_Integer for c in poly.coeffs()):
                return str(expr)
        return str(int(expr.subs(self.hints)))


def _input_code(value: Any, symbols: _Symbols) -> str | None:
    if isinstance(value, torch.Tensor):
        shape = ", ".join(symbols.code(s) for s in value.shape)
        shape = f"({shape},)" if value.dim() == 1 else f"({shape})"
        dev = "" if value.device.type == "cpu" else f", device={str(value.device)!r}"
        dtype = str(value.dtype)
        if value.dtype.is_floating_point or value.dtype.is_complex:
            return f"torch.rand({shape}, dtype={dtype}{dev})"
        return f"torch.zeros({shape}, dtype={dtype}{dev})"
    if isinstance(value, torch.SymInt):
        return symbols.code(value)
    if isinstance(value, (int, float, bool)) or value is None:
        return repr(value)
    return None


def _harness(gm: torch.fx.GraphModule) -> tuple[str, str | None]:
    """The harness code, or why there is none."""
    symbols = _Symbols()
    inputs = []
    for node in gm.graph.find_nodes(op="placeholder"):
        code = _input_code(example_value(node), symbols)
        if code is None:
            return "", f"input {node.name!r} has no traced value this harness can rebuild"
        inputs.append(f"        {code},  # {node.name}")
    for sub in _graph_modules(gm):
        if any(n.op == "get_attr" for n in sub.graph.nodes):
            return "", "the graph reads module attributes (get_attr) that are not part of the file"
    children = [name for name, m in gm.named_children() if isinstance(m, torch.fx.GraphModule)]
    if any(not name.isidentifier() for name in children):
        return "", "nested submodule names are not identifiers"
    params = ", ".join(f"{s}: int = {v}" for s, v in sorted(symbols.hints.items(), key=lambda kv: str(kv[0])))
    lines = [
        "",
        "",
        "# ---- harness (generated by ppcompile): random inputs shaped like the traced ones ----",
        f"def example_inputs({params}) -> list:",
        '    """Floats uniform in [0, 1), integers zero; one keyword per symbolic size."""',
        "    return [",
        *inputs,
        "    ]",
        "",
        "",
        "def make_module() -> torch.nn.Module:",
        "    mod = GraphModule()",
        # print_readable nests submodules as classes; an instance in __dict__ shadows the class attribute.
        *[f"    mod.__dict__[{c!r}] = GraphModule.{c}()" for c in children],
        "    return mod",
        "",
        "",
        'if __name__ == "__main__":',
        "    with torch.no_grad():",
        "        out = make_module()(*example_inputs())",
        "    for i, o in enumerate(out if isinstance(out, (tuple, list)) else [out]):",
        "        print(i, tuple(o.shape) if isinstance(o, torch.Tensor) else o,",
        "              o.dtype if isinstance(o, torch.Tensor) else type(o).__name__)",
    ]
    return "\n".join(lines) + "\n", None


def runnable_source(gm: torch.fx.GraphModule, title: str) -> str:
    """The text of a runnable Python file for ``gm``; ``title`` becomes its first comment line."""
    code = gm.print_readable(print_output=False, include_stride=False, include_device=False, colored=False)
    imports, missing = _global_imports(gm)
    harness, why_not = _harness(gm)
    head = [f"# ppcompile: {title}", "# Run: python THIS_FILE (random inputs), or import it and call",
            "#      make_module()(*example_inputs(...)). Generated; edits are lost at the next dump.",
            "import torch", "from torch import device, inf, nan  # names print_readable code may use"]
    head += _op_imports(gm) + imports
    if missing:
        head.append(f"# not importable (define them before running): {', '.join(missing)}")
    if why_not:
        head.append(f"# no harness: {why_not}")
    return "\n".join(head) + "\n\n\n" + code.rstrip() + "\n" + harness

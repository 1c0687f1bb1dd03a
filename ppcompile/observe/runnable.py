"""A graph module as a runnable Python file: ``print_readable`` code plus a small harness.

The file defines ``GraphModule`` (nested submodules as nested classes, exactly as ``print_readable``
writes them), imports what the code names, and adds ``example_inputs(**sizes)`` (random tensors shaped
like the traced inputs; one keyword per symbolic size, defaulting to its traced value) and
``make_module()``. Run it with ``python FILE`` to execute the graph once on those inputs, or import it
and call ``make_module()(*example_inputs(s0=64))``.

Ops that read engine state need it to run. For the reference models' attention (``ppcompile::attention``
and ``ppcompile::attention_with_output``, which read a forward context), the harness also defines
``forward_context(**sizes)``: a context for one sequence of the example's tokens with zeroed KV caches of
the layers the graph attends, built from the traced shapes of its keys; running the file enters it. For
an engine's own attention or state-writing ops (``engine_ops.py``: vLLM's forward context), the file says
so in its header (:data:`NOT_RUNNABLE`) and, run as a script, prints that and exits 0 without running.
"""

from __future__ import annotations

import operator
from typing import Any

import sympy
import torch

from ppcompile.engine_ops import OpRole, engine_op
from ppcompile.symbolic import example_value, size_expr, size_hints
from ppcompile.torch_internals import (
    OpOverload,
    OpOverloadPacket,
    custom_op_module,
)

__all__ = ["NOT_RUNNABLE", "not_runnable_reason", "runnable_source"]

#: The header line of a file whose harness does not run the graph, followed by why.
NOT_RUNNABLE = "# Not runnable as is: "
# The reference models' attention ops (ppcompile/models/attention.py): each reads the forward context's
# KV cache of its ``layer_id`` (shaped like its ``k``) and the batch's sequences; the harness builds one.
_REFERENCE_ATTENTION = ("ppcompile::attention", "ppcompile::attention_with_output")
_CONTEXT_MODULE = "ppcompile.models.attention"

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


def _call_args(node: torch.fx.Node) -> tuple[str | None, dict[str, Any]]:
    """``("ns::op", {argument name: value})`` of an op call, or ``(None, {})`` for anything else."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, (OpOverload, OpOverloadPacket)):
        return None, {}
    overload = target if isinstance(target, OpOverload) else getattr(target, "default", None)
    packet = target.overloadpacket if isinstance(target, OpOverload) else target
    qualname = str(packet._qualified_op_name)
    if overload is None:
        return qualname, dict(node.kwargs)
    names = [a.name for a in overload._schema.arguments]
    return qualname, {**dict(zip(names, node.args)), **node.kwargs}


def _forward_context(gm: torch.fx.GraphModule, symbols: _Symbols) -> tuple[list[str], str | None]:
    """The body of ``forward_context(**sizes)`` for the reference attention calls of ``gm`` (no lines:
    the graph needs no context), or why the harness cannot run the graph."""
    caches: dict[int, str] = {}
    tokens: set[str] = set()
    device = ""
    for sub in _graph_modules(gm):
        for node in sub.graph.nodes:
            qualname, args = _call_args(node)
            if qualname is None:
                continue
            known = engine_op(qualname)
            if known is not None and known.role in (OpRole.ATTENTION, OpRole.STATE_WRITE):
                return [], (f"{qualname} reads {known.engine}'s forward context ({known.role.value}); "
                            "run make_module()(*example_inputs()) inside the engine's forward")
            if qualname not in _REFERENCE_ATTENTION:
                continue
            key = example_value(args["k"]) if isinstance(args.get("k"), torch.fx.Node) else None
            layer = args.get("layer_id")
            if not isinstance(key, torch.Tensor) or key.dim() != 3 or not isinstance(layer, int):
                return [], f"{qualname} ({node.name}) has no traced key tensor or constant layer id"
            tokens.add(symbols.code(key.shape[0]))
            caches[layer] = (f"torch.zeros((tokens, 2, {symbols.code(key.shape[1])}, "
                             f"{symbols.code(key.shape[2])}), dtype={key.dtype}{{dev}})")
            device = "" if key.device.type == "cpu" else f", device={str(key.device)!r}"
    if not caches:
        return [], None
    if len(tokens) != 1:
        return [], f"its attention calls see different token counts ({', '.join(sorted(tokens))})"
    return [
        f"    from {_CONTEXT_MODULE} import ForwardContext, set_forward_context",
        "",
        f"    tokens = {tokens.pop()}",
        "    return set_forward_context(ForwardContext(",
        "        seq_lens=[tokens],",
        f"        cu_seqlens=torch.tensor([0, tokens], dtype=torch.int32{device}),",
        f"        slot_mapping=torch.arange(tokens{device}),",
        "        kv_caches={",
        *[f"            {layer}: {code.format(dev=device)}," for layer, code in sorted(caches.items())],
        "        },",
        "    ))",
    ], None


def _main_block(context: bool) -> list[str]:
    """What running the file as a script does: the graph once on the example inputs (in the made-up
    forward context when it needs one), then each output's shape and dtype."""
    run = "with torch.no_grad(), forward_context():" if context else "with torch.no_grad():"
    return [
        'if __name__ == "__main__":',
        f"    {run}",
        "        out = make_module()(*example_inputs())",
        "    for i, o in enumerate(out if isinstance(out, (tuple, list)) else [out]):",
        "        print(i, tuple(o.shape) if isinstance(o, torch.Tensor) else o,",
        "              o.dtype if isinstance(o, torch.Tensor) else type(o).__name__)",
    ]


def _not_run_block(why: str) -> list[str]:
    """What running the file as a script does when the harness cannot run the graph: says so, exits 0."""
    return ['if __name__ == "__main__":', f"    print({('not run: ' + why)!r})", "    raise SystemExit(0)"]


def _harness(gm: torch.fx.GraphModule) -> tuple[list[str], bool, str | None]:
    """The harness's definitions (none when there can be none), whether they include
    ``forward_context``, and why running the file cannot run the graph (None: it can)."""
    symbols = _Symbols()
    inputs = []
    for node in gm.graph.find_nodes(op="placeholder"):
        code = _input_code(example_value(node), symbols)
        if code is None:
            return [], False, f"no harness: input {node.name!r} has no traced value this harness can rebuild"
        inputs.append(f"        {code},  # {node.name}")
    for sub in _graph_modules(gm):
        if any(n.op == "get_attr" for n in sub.graph.nodes):
            return [], False, "no harness: the graph reads module attributes (get_attr) not in the file"
    children = [name for name, m in gm.named_children() if isinstance(m, torch.fx.GraphModule)]
    cls = type(gm).__name__  # print_readable's class name: Dynamo's graphs are GraphModule
    if any(not name.isidentifier() for name in [cls, *children]):
        return [], False, "no harness: the class or nested submodule names are not identifiers"
    context, why_not = _forward_context(gm, symbols)
    params = ", ".join(f"{s}: int = {v}" for s, v in sorted(symbols.hints.items(), key=lambda kv: str(kv[0])))
    lines = [
        "# ---- harness (generated by ppcompile): random inputs shaped like the traced ones ----",
        f"def example_inputs({params}) -> list:",
        '    """Floats uniform in [0, 1), integers zero; one keyword per symbolic size."""',
        "    return [",
        *inputs,
        "    ]",
        "",
        "",
        "def make_module() -> torch.nn.Module:",
        f"    mod = {cls}()",
        # print_readable nests submodules as classes; an instance in __dict__ shadows the class attribute.
        *[f"    mod.__dict__[{c!r}] = {cls}.{c}()" for c in children],
        "    return mod",
    ]
    if context:
        lines += [
            "",
            "",
            f"def forward_context({params}):",
            f'    """The forward context of the attention ops ({_CONTEXT_MODULE}), made up for the example:',
            '    one sequence of its tokens, zeroed KV caches of the layers this graph attends."""',
            *context,
        ]
    return lines, bool(context), why_not


def runnable_source(gm: torch.fx.GraphModule, title: str) -> str:
    """The text of a runnable Python file for ``gm``; ``title`` becomes its first comment line."""
    code = gm.print_readable(print_output=False, include_stride=False, include_device=False, colored=False)
    imports, missing = _global_imports(gm)
    harness, context, why_not = _harness(gm)
    if why_not is None and missing:
        why_not = f"names not importable, define them before running: {', '.join(missing)}"
    head = [f"# ppcompile: {title}"]
    if why_not is not None:
        head.append(f"{NOT_RUNNABLE}{why_not}")
    elif context:
        head += ["# Run: python THIS_FILE (random inputs, in a made-up forward context), or import it and",
                 "#      call make_module()(*example_inputs(...)) inside `with forward_context(...):`."]
    else:
        head += ["# Run: python THIS_FILE (random inputs), or import it and call",
                 "#      make_module()(*example_inputs(...))."]
    head += ["# Generated; edits are lost at the next dump.",
             "import torch", "from torch import device, inf, nan  # names print_readable code may use"]
    head += _op_imports(gm) + imports
    main = _main_block(context) if why_not is None else _not_run_block(why_not)
    tail = "\n\n\n".join(["\n".join(harness), "\n".join(main)]) if harness else "\n".join(main)
    return "\n".join(head) + "\n\n\n" + code.rstrip() + "\n\n\n" + tail + "\n"


def not_runnable_reason(text: str) -> str | None:
    """Why the file ``text`` (one :func:`runnable_source` wrote) does not run its graph as a script, or
    None when ``python FILE`` runs it."""
    for line in text.splitlines()[:3]:
        if line.startswith(NOT_RUNNABLE):
            return line.removeprefix(NOT_RUNNABLE)
    return None

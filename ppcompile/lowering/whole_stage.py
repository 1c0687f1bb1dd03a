"""Planning whole-stage graphs: whether a stage can run as one graph per small bucket, and how its inputs
reach that graph (``runtime/whole_stage.py`` serves the plan).

A stage qualifies when every break segment holds only ops declared capturable (``ppcompile.capturable``)
and each declared metadata argument is a stage input (a placeholder, passed straight to the op). Any
other break (an undeclared attention, a padding-unsafe op, a host scalar, an eager region) keeps the
stage breakable at every size, with the reason in ``describe()`` and the report.

Before (split stage graph: graph, capturable break, graph)::

    def forward(self, s0, L_hidden_, L_meta_slot_mapping_, L_meta_seq_lens_, ...):
        submod_0 = self.submod_0(L_hidden_, ...)                       # graph
        submod_1 = self.submod_1(submod_0, ..., L_meta_slot_mapping_)  # ppcompile.paged_attention
        submod_2 = self.submod_2(submod_1, ...)                        # graph

After (the plan; the split graph is unchanged)::

    WholeStagePlan(max_tokens=256, inputs=(size s0, token L_hidden_ dims ((0, s0),),
                   metadata L_meta_slot_mapping_ Metadata(TOKENS, pad=-1), ...),
                   outputs=(("tensor", ((0, s0),)),), ops=("ppcompile::paged_attention",))
"""

from __future__ import annotations

from typing import Any

import sympy
import torch

from ppcompile.analysis.node_facts import BREAK_CAUSE, CAPTURE_UNSAFE, SEGMENT, WRITTEN_ARGS
from ppcompile.analysis.op_matching import argument_of
from ppcompile.capturable import CapturableBreak, Metadata, capturable_break
from ppcompile.config import PPBreakableConfig
from ppcompile.passes.context import PassContext
from ppcompile.records import BreakKind, InputKind
from ppcompile.runtime.program import Program, Ref
from ppcompile.runtime.whole_stage import WholeInput, WholeStagePlan
from ppcompile.symbolic import example_value, shape_exprs
from ppcompile.torch_internals.ops import qualified_op_name

__all__ = ["plan_whole_stage"]


class _Refused(Exception):
    """Why the stage cannot run whole (raised inside the planner, returned as its reason)."""


# Why a declared op breaks on the breakable path, which its declaration answers inside a whole graph.
_DECLARATION_ANSWERS = frozenset({BreakKind.ATTENTION, BreakKind.USER_SPLIT_OP, BreakKind.STATE_WRITE,
                                  BreakKind.NON_TOKEN_SHAPE, BreakKind.UNSAFE_OP})


def _declared_ops(split: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, torch.fx.Node, CapturableBreak]]:
    """(segment call, op node inside it, declaration) for every declared op of every break; refuses a
    break with a node that breaks for another cause (ops folded into a break break for none)."""
    found = []
    for call in split.graph.find_nodes(op="call_module"):
        segment = SEGMENT.of(call)
        if segment.is_graph:
            continue
        submod = split.get_submodule(str(call.target))
        assert isinstance(submod, torch.fx.GraphModule)
        for node in submod.graph.nodes:
            cause = BREAK_CAUSE.get(node)
            if cause is None:
                continue
            name = qualified_op_name(node.target) if node.op == "call_function" else None
            entry = capturable_break(name) if name else None
            if entry is None or cause.kind not in _DECLARATION_ANSWERS:
                what = "declares no capture contract (ppcompile.declare_capturable)" if entry is None else \
                    "is declared capturable, but breaks for another reason"
                raise _Refused(f"break {segment.name}: {cause.op} ({cause.kind.value}) {what}")
            if entry.refused:
                raise _Refused(f"break {segment.name}: {name} {entry.refused}")
            if (why := CAPTURE_UNSAFE.get(node)) is not None:
                raise _Refused(f"break {segment.name}: {name} is declared capturable, but {why}")
            found.append((call, node, entry))
    return found


def _metadata_inputs(split: torch.fx.GraphModule, declared: list[Any]) -> dict[int, Metadata]:
    """Stage input index -> its metadata rule, from each declared op's metadata arguments."""
    placeholders = list(split.graph.find_nodes(op="placeholder"))
    rules: dict[int, Metadata] = {}
    for call, node, entry in declared:
        submod = split.get_submodule(str(call.target))
        assert isinstance(submod, torch.fx.GraphModule)
        inner = list(submod.graph.find_nodes(op="placeholder"))
        for arg_name, meta in entry.metadata.items():
            arg = argument_of(node, arg_name)
            outer = call.args[inner.index(arg)] if isinstance(arg, torch.fx.Node) and arg in inner else None
            if not isinstance(outer, torch.fx.Node) or outer.op != "placeholder":
                raise _Refused(f"{entry.op}'s metadata {arg_name!r} is computed inside the stage; pass it "
                               "to the stage as an input so it can be padded")
            index = placeholders.index(outer)
            if rules.get(index, meta) != meta:
                raise _Refused(f"input {outer.name} is metadata of two kinds ({rules[index]} and {meta})")
            rules[index] = meta
    return rules


def _written_inputs(split: torch.fx.GraphModule) -> set[int]:
    placeholders = list(split.graph.find_nodes(op="placeholder"))
    written = set()
    for call in split.graph.find_nodes(op="call_module"):
        for k in WRITTEN_ARGS.get(call) or ():
            arg = call.args[k]
            if isinstance(arg, torch.fx.Node) and arg in placeholders:
                written.add(placeholders.index(arg))
    return written


def _inputs(split: torch.fx.GraphModule, program: Program, ctx: PassContext,
            rules: dict[int, Metadata]) -> tuple[tuple[WholeInput, ...], list[tuple[sympy.Symbol, int, int]]]:
    written = _written_inputs(split)
    inputs: list[WholeInput] = []
    bare: dict[sympy.Symbol, tuple[int, int]] = {}
    for i, node in enumerate(split.graph.find_nodes(op="placeholder")):
        kind = ctx.input_kinds[i]
        if kind is InputKind.SYMINT:
            expr = ctx.symint_inputs.get(i)
            if not isinstance(expr, sympy.Symbol):
                raise _Refused(f"input {node.name} is a size expression ({expr}), not a symbol")
            inputs.append(WholeInput(i, node.name, "size", symbol=expr))
            continue
        if kind in (InputKind.SCALAR_ARG,):
            raise _Refused(f"input {node.name} is a number passed per call, which a graph would bake")
        value = example_value(node)
        if kind is not InputKind.TENSOR or not isinstance(value, torch.Tensor):
            inputs.append(WholeInput(i, node.name, "pass"))
            continue
        if i in rules and i in written:
            raise _Refused(f"the stage writes its metadata input {node.name} in place")
        for d, expr in enumerate(shape_exprs(value)):
            if isinstance(expr, sympy.Symbol) and expr != ctx.token_symbol:
                bare.setdefault(expr, (i, d))
        if i in rules:
            if ctx.token_input is not None and ctx.token_input[0] == i:
                raise _Refused(f"the token count is read off metadata input {node.name} (the token inputs "
                               "have a static size: Dynamo specialised them)")
            inputs.append(WholeInput(i, node.name, "metadata", metadata=rules[i]))
            continue
        dims = program.token_dims.get(i, ())
        if not dims and any(e.free_symbols for e in shape_exprs(value)):
            raise _Refused(f"input {node.name} has a dynamic size other than the token count "
                           f"({list(value.shape)}) and is no declared metadata")
        inputs.append(WholeInput(i, node.name, "token" if dims else "fixed", dims=dims, written=i in written))
    symbols: list[tuple[sympy.Symbol, int, int]] = []
    for inp in inputs:
        if inp.symbol is None or inp.symbol == ctx.token_symbol:
            continue
        if inp.symbol not in bare:
            raise _Refused(f"size {inp.name} is neither the token count nor a dim of an input")
        symbols.append((inp.symbol, *bare[inp.symbol]))
    return tuple(inputs), symbols


def _outputs(split: torch.fx.GraphModule, program: Program) -> tuple[tuple[str, Any], ...]:
    (out,) = split.graph.find_nodes(op="output")
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    plans: list[tuple[str, Any]] = []
    for ref, node in zip(program.outputs, values):
        if not isinstance(ref, Ref):
            plans.append(("const", ref))
        elif ref.size is not None:
            plans.append(("size", ref.size))
        elif isinstance(example_value(node), torch.Tensor):
            plans.append(("tensor", program.token_dims.get(ref.slot, ())))
        else:
            raise _Refused(f"output {node} is a number the stage computes, which a graph would bake")
    return tuple(plans)


def plan_whole_stage(split: torch.fx.GraphModule, program: Program, ctx: PassContext,
                     config: PPBreakableConfig) -> tuple[WholeStagePlan | None, str | None]:
    """The whole-stage plan of ``split`` (after the passes; ``program`` lowered from it), or None and why
    not (None and None: nothing to gain, the stage has no break or whole graphs are off)."""
    if config.whole_graph_tokens == 0 or ctx.is_static or not program.break_steps:
        return None, None
    try:
        declared = _declared_ops(split)
        rules = _metadata_inputs(split, declared)
        inputs, symbols = _inputs(split, program, ctx, rules)
        outputs = _outputs(split, program)
    except _Refused as why:
        return None, str(why)
    caps = [e.max_requests for _, _, e in declared if e.max_requests is not None]
    ops = tuple(dict.fromkeys(e.op for _, _, e in declared))
    return WholeStagePlan(config.whole_graph_tokens, min(caps) if caps else None, inputs, tuple(symbols),
                          outputs, ops), None

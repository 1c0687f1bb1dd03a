"""``lower_stage``: the one frozen hand-off from the compile side to the runtime (``CompiledStage``).

Everything the runtime needs is decided here, once, from the split graph and the passes' facts: the
flat program, the bucket plan (less the sizes the graph's shape guards refuse), which inputs are module
state, scalars, tensors and sizes, what the input checks and the live-path layout checks compare, and
why every forward must run eagerly, if it must. ``StageRuntime(compiled, config)`` is built from it and
the config alone; the pass context is not kept.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import sympy
import torch

from ppcompile.config import PPBreakableConfig, live_mode_reason
from ppcompile.lowering.program import build_program
from ppcompile.lowering.whole_stage import plan_whole_stage
from ppcompile.passes.context import PassContext, StaticInputPlan
from ppcompile.records import InputKind, SegmentCompile
from ppcompile.runtime.buckets import BucketPlan, make_bucket_plan
from ppcompile.runtime.compiled_stage import CompiledStage, CompileRecord
from ppcompile.runtime.layout_checks import checked_values
from ppcompile.runtime.program import Program
from ppcompile.runtime.validation import InputSpec
from ppcompile.symbolic import SizeFn, holds_at

__all__ = ["input_specs", "lower_stage"]


def input_specs(plans: Iterable[StaticInputPlan], known: Iterable[sympy.Symbol]) -> tuple[InputSpec, ...]:
    """One spec per lifted input; dims whose size depends on a symbol outside ``known`` go unchecked."""
    known_symbols = frozenset(known)
    specs = []
    for plan in plans:
        buf = plan.buffer
        fixed, sized = [], []
        for d, expr in enumerate(plan.size_exprs):
            if not expr.free_symbols:
                fixed.append((d, int(expr)))
            elif expr.free_symbols <= known_symbols:
                sized.append((d, SizeFn(expr)))
        specs.append(InputSpec(
            slot=plan.input_index,
            name=buf.name,
            dtype=buf.dtype,
            device=torch.device(buf.device),
            ndim=len(plan.size_exprs),
            fixed=tuple(fixed),
            sized=tuple(sized),
        ))
    return tuple(specs)


def _admitted_by(ctx: PassContext) -> Callable[[int], bool] | None:
    """Which bucket sizes the stage graph can run at: those where its shape guards on the token count hold
    (a graph Dynamo traced for ``n % 16 == 15`` has sizes simplified for such counts only)."""
    token, guards = ctx.token_symbol, ctx.token_guards
    if token is None or not guards:
        return None
    return lambda size: holds_at(guards, token, size)


def batch_first_hint(example_inputs: Iterable[Any]) -> str:
    """``"; graph input k has shape [1, T, ...]: ..."`` when an input looks batch-first (a batch dim of 1
    before a longer dim), whose dim 0 then reads as a 1-token count; else ``""``."""
    for k, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor) and x.dim() >= 3 and x.shape[0] == 1 and x.shape[1] > 1:
            return (f"; graph input {k} has shape {list(x.shape)}: batch-first? ppcompile reads dim 0 as the "
                    "token dim (stages are token-major, [T, ...]): squeeze the batch dim before the "
                    "stage, or mark the token dim (ppcompile.mark_token_dynamic(t, dim=1)) if it really "
                    "is dim 1")
    return ""


def _policy_reason(
    ctx: PassContext, program: Program, config: PPBreakableConfig, graph_mode: str
) -> str | None:
    """Why every forward runs eagerly by a documented policy or limit of ppcompile's, or None."""
    if ctx.is_static:
        return (
            "Dynamo traced concrete token sizes: it does for a 1-token call (a size of 1 is a constant, "
            "even on a marked dim), for the first call with dynamic=None, and when the first token count "
            "equals another dim of the inputs (duck sizing). Its calls run eagerly until Dynamo compiles "
            "a stage graph of the same module with a symbolic token count (at a call of another count), "
            "whose buckets then serve them; against the last two causes, mark the token dims before the "
            "first call (ppcompile.mark_token_dynamic)" + batch_first_hint(ctx.example_inputs)
        )
    if not ctx.eligible:
        return ctx.ineligible_reason
    if graph_mode == "none":
        return live_mode_reason(config.graph_mode)
    readable = (InputKind.MODULE_STATE, InputKind.TENSOR, InputKind.CONSTANT_SCALAR)
    for st in program.graph_steps:
        for r in st.args:
            if 0 <= r.slot < len(ctx.input_kinds) and ctx.input_kinds[r.slot] not in readable:
                return f"graph segment {st.segment.name} reads a non-tensor input (slot {r.slot})"
    if not program.graph_steps:
        return "the stage has no graph segments"
    return None


def never_graphs_reason(plan: BucketPlan) -> str:
    """Why a stage graph whose shape guards refuse every capture size runs eagerly: not a policy of
    ppcompile's but a fall-off (the runtime warns once and counts it)."""
    return (f"no capture size is a token count the stage graph was traced for (Dynamo's shape guards "
            f"fail at {', '.join(map(str, plan.refused))}): the model's code guards on the token count "
            "(a parity or a remainder, e.g. chunk padding), so Dynamo traced this graph for a class of "
            "counts no bucket belongs to; give capture_sizes in that class, or remove the guard")


def lower_stage(
    name: str,
    split: torch.fx.GraphModule,
    ctx: PassContext,
    compiled: dict[str, Callable[..., Any]],
    config: PPBreakableConfig,
    graph_mode: str,
    *,
    skip_size_asserts: bool = False,
    segment_compiles: tuple[SegmentCompile, ...] = (),
    compile_times: Mapping[str, float] | None = None,
    compile_id: object | None = None,
    frame_compile: int | None = None,
    recompile_limit: int | None = None,
) -> CompiledStage:
    """The frozen stage: ``split`` (after the passes) with its compiled segment callables.
    ``skip_size_asserts``: the compiled segments do not check their inputs' sizes and strides (the live
    path checks what no guard or segment vouches for)."""
    program = build_program(split, compiled, token=ctx.token_symbol,
                            traced_strides=config.segment_compiler != "eager" and not ctx.is_static,
                            output_slots=config.output_slots)
    kinds = ctx.input_kinds
    symbol_slots = tuple((i, e) for i, e in ctx.symint_inputs.items() if isinstance(e, sympy.Symbol))
    tensor_slots = tuple(i for i, k in enumerate(kinds) if k is InputKind.TENSOR)
    known = {e for _, e in symbol_slots} | ({ctx.token_symbol} if ctx.token_symbol else set())
    plan = make_bucket_plan(config, _admitted_by(ctx))
    policy = _policy_reason(ctx, program, config, graph_mode)
    never_graphs = policy is None and not plan.sizes  # a fall-off, not a policy: the runtime warns
    whole, whole_reason = plan_whole_stage(split, program, ctx, config) if policy is None else (None, None)
    return CompiledStage(
        name=name,
        graph_mode=graph_mode,
        program=program,
        plan=plan,
        segments=tuple(st.segment for st in program.steps),
        layer_ids=tuple(ctx.layer_ids),
        token_symbol=ctx.token_symbol,
        token_input=ctx.token_input,
        symbol_slots=symbol_slots,
        state_slots=tuple(i for i, k in enumerate(kinds) if k is InputKind.MODULE_STATE),
        scalar_slots=tuple(i for i, k in enumerate(kinds) if k is InputKind.CONSTANT_SCALAR),
        tensor_slots=tensor_slots,
        input_specs=input_specs(ctx.static_inputs, known),
        live_checks=tuple(checked_values(program, tensor_slots, known))
        if skip_size_asserts and not ctx.is_static else (),
        eager_reason=policy or (never_graphs_reason(plan) if never_graphs else None),
        never_graphs=never_graphs,
        collectives=ctx.collectives,
        bound_inputs=tuple(ctx.bound_inputs),
        input_names=tuple(n.name for n in split.graph.find_nodes(op="placeholder")),
        merged_token_dims=ctx.merged_token_dims,
        whole=whole,
        whole_reason=whole_reason,
        record=CompileRecord(
            split_module=split,
            pass_times=types.MappingProxyType(dict(ctx.pass_times)),
            compile_times=types.MappingProxyType(dict(compile_times or {})),
            segment_compiles=tuple(segment_compiles),
            compile_id=compile_id,
            frame_compile=frame_compile,
            recompile_limit=recompile_limit,
            region_traces=types.MappingProxyType(dict(ctx.region_traces)),
            stamped_layers=ctx.stamped_layers,
            traced_flat=types.MappingProxyType(dict(ctx.traced_flat)),
        ),
    )

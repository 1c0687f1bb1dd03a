"""``StageRuntime``: serves each call of a compiled stage by a captured bucket or eagerly.

Per call with ``n`` live tokens:

1. pick the bucket ``b >= n`` (O(1) table); above the cap, beyond the padding guard, with autograd on,
   or for a stage that cannot be graphed, run every segment eagerly on live tensors instead;
2. copy live inputs into the static input buffers (``[:n]``) and zero their padding rows (``[n:b]``);
3. walk the segments: a graph segment replays its bucket-``b`` graph; a break segment runs eagerly on
   ``[:n]`` views and its outputs that graphs read are copied into static bridges;
4. return outputs trimmed to their live size (views into static outputs, valid until the next call,
   or copies with ``owned_outputs=True``).

Graphs and static buffers belong to the module state they read: one ``_InstanceState`` per set of
parameter tensors, so two module instances that share one Dynamo graph never share graphs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import sympy
import torch

from ppcompile.config import PPBreakableConfig
from ppcompile.counters import counters
from ppcompile.passes.context import PassContext
from ppcompile.records import InputKind
from ppcompile.runtime.buckets import BucketPlan
from ppcompile.runtime.executors import GraphExecutor, make_executor
from ppcompile.runtime.program import Program, Ref
from ppcompile.runtime.static_buffers import allocate, copy_in, narrow_to

__all__ = ["StageRuntime"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _InstanceState:
    """Static buffers and captured graphs for one set of module-state tensors."""

    executor: GraphExecutor
    module_state: tuple[torch.Tensor, ...]  # strong references: the graphs read them (and bake scalars)
    input_buffers: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    bridge_buffers: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    tables: dict[int, list[Any]] = dataclasses.field(default_factory=dict)
    failed: str | None = None


class StageRuntime:
    """The callable the ``pp_breakable`` backend hands back to Dynamo for one stage graph."""

    def __init__(
        self,
        name: str,
        program: Program,
        ctx: PassContext,
        plan: BucketPlan,
        graph_mode: str,
        config: PPBreakableConfig,
    ) -> None:
        self.name = name
        self.program = program
        self.plan = plan
        self.graph_mode = graph_mode
        self.config = config
        self.segments = ctx.segments
        self.break_reasons = [s.reason for s in ctx.segments if s.reason is not None]
        self.layer_ids = ctx.layer_ids
        self.static_inputs = ctx.static_inputs
        self.trims = ctx.trims
        self.token_symbol: sympy.Symbol | None = ctx.token_symbol
        self._state_slots = tuple(i for i, k in enumerate(ctx.input_kinds) if k is InputKind.MODULE_STATE)
        self._scalar_slots = tuple(i for i, k in enumerate(ctx.input_kinds) if k is InputKind.CONSTANT_SCALAR)
        self._symbol_slots = tuple(
            (i, e) for i, e in ctx.symint_inputs.items() if isinstance(e, sympy.Symbol)
        )
        self._token_slot = next((i for i, e in self._symbol_slots if e == ctx.token_symbol), None)
        self._token_input = ctx.token_input
        self._states: dict[tuple[Any, ...], _InstanceState] = {}
        self._owned_slots = frozenset(s for st in program.steps if st.segment.is_graph for s in st.live_views)
        self._warned: set[str] = set()
        self.eager_reason = self._why_never_graphed(ctx)
        if self.eager_reason:
            log.info("%s: every forward runs eagerly: %s", name, self.eager_reason)

    # ----------------------------------------------------------------------------------- policy
    def _why_never_graphed(self, ctx: PassContext) -> str | None:
        if ctx.is_static:
            return "Dynamo traced concrete sizes (no dynamic token dim); use dynamic=True or mark_dynamic"
        if not ctx.eligible:
            return ctx.ineligible_reason
        if self.graph_mode == "none":
            return "graphs are off"
        kinds = ctx.input_kinds
        for st in self.program.steps:
            if not st.segment.is_graph:
                continue
            for r in st.args:
                readable = (InputKind.MODULE_STATE, InputKind.TENSOR, InputKind.CONSTANT_SCALAR)
                if 0 <= r.slot < len(kinds) and kinds[r.slot] not in readable:
                    return f"graph segment {st.segment.name} reads a non-tensor input (slot {r.slot})"
        if not any(st.segment.is_graph for st in self.program.steps):
            return "the stage has no graph segments"
        return None

    def num_tokens(self, args: tuple[Any, ...]) -> int:
        """The live token count of a call."""
        if self._token_slot is not None:
            return int(args[self._token_slot])
        assert self._token_input is not None
        i, d = self._token_input
        return int(args[i].shape[d])

    def _env(self, args: tuple[Any, ...], tokens: int) -> dict[sympy.Symbol, int]:
        env = {e: int(args[i]) for i, e in self._symbol_slots}
        if self.token_symbol is not None:
            env[self.token_symbol] = tokens
        return env

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    # ----------------------------------------------------------------------------------- call
    def __call__(self, *args: Any) -> tuple[Any, ...]:
        if self.eager_reason is not None:
            return self.run_eager(args)
        n = self.num_tokens(args)
        b = self.plan.bucket(n)
        if b is None:
            return self.run_eager(args)
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            self._warn_once("grad", "%s: inputs require grad with autograd enabled, so forwards run "
                            "eagerly; run inference under torch.inference_mode() or torch.no_grad() to "
                            "use graphs", self.name)
            return self.run_eager(args)
        state = self._state_for(args)
        if state.failed is not None:
            self._warn_once("failed", "%s: graphs disabled after a failed capture (%s); running eagerly",
                            self.name, state.failed)
            return self.run_eager(args)
        return self._run_graphs(state, args, n, b)

    def run_eager(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """Every segment on live tensors: no static buffers, no graphs."""
        counters.eager_runs += 1
        env = self._env(args, self.num_tokens(args)) if self.token_symbol is not None else self._env(args, 0)
        live: list[Any] = list(args) + [None] * (self.program.num_slots - len(args))
        for step in self.program.steps:
            outs = step.fn(*[live[r.slot] if r.size is None else r.size(env) for r in step.args])
            for s, o in zip(step.out_slots, outs):
                if s >= 0:
                    live[s] = o
        return self._outputs(live, env, owned=False)

    def _run_graphs(self, state: _InstanceState, args: tuple[Any, ...], n: int, b: int) -> tuple[Any, ...]:
        program = self.program
        env_n = self._env(args, n)
        env_b = dict(env_n)
        env_b[self.token_symbol] = b
        executor = state.executor
        static = state.tables[b]
        if not executor.binds_inputs:
            static = list(static)
        token_dims = program.token_dims
        for slot, buf in state.input_buffers.items():
            copy_in(buf, args[slot], token_dims.get(slot, ()), env_n, env_b)
        live: list[Any] = list(args) + [None] * (program.num_slots - len(args))
        # A bound graph reads what it captured: its arguments matter only to the debug address check.
        resolve_graph_args = not executor.binds_inputs or self.config.debug
        for step in program.steps:
            if step.segment.is_graph:
                sargs = (
                    [static[r.slot] if r.size is None else r.size(env_b) for r in step.args]
                    if resolve_graph_args else ()
                )
                outs: Sequence[Any] = executor.replay((step.index, b), sargs)
                if not executor.binds_inputs:
                    for s, o in zip(step.out_slots, outs):
                        if s >= 0:
                            static[s] = o
                for s in step.live_views:
                    live[s] = narrow_to(static[s], token_dims.get(s, ()), env_n)
                for s in step.live_values:
                    live[s] = static[s]
            else:
                outs = step.fn(*[live[r.slot] if r.size is None else r.size(env_n) for r in step.args])
                for s, o in zip(step.out_slots, outs):
                    if s >= 0:
                        live[s] = o
                for s in step.bridges:
                    copy_in(state.bridge_buffers[s], live[s], token_dims.get(s, ()), env_n, env_b)
        counters.replays += 1
        counters.replays_by_bucket[b] += 1
        return self._outputs(live, env_n, owned=self.config.owned_outputs)

    def _outputs(self, live: list[Any], env: dict[sympy.Symbol, int], owned: bool) -> tuple[Any, ...]:
        out = []
        for r in self.program.outputs:
            if not isinstance(r, Ref):
                out.append(r)
            elif r.size is not None:
                out.append(r.size(env))
            else:
                value = live[r.slot]
                out.append(value.clone() if owned and r.slot in self._owned_slots else value)
        return tuple(out)

    # ----------------------------------------------------------------------------------- capture
    def _state_for(self, args: tuple[Any, ...]) -> _InstanceState:
        # Graphs read module state in place and bake constant scalars (a norm's eps) at capture: key
        # the captured graphs by the identity of the one and the value of the other, and by inference
        # mode, whose tensors (static buffers, graph outputs) cannot be written outside it.
        key = (
            torch.is_inference_mode_enabled(),
            *map(id, [args[i] for i in self._state_slots]),
            *[args[i].item() for i in self._scalar_slots],
        )
        state = self._states.get(key)
        if state is None:
            state = self._capture(args, key)
        return state

    def _capture(self, args: tuple[Any, ...], key: tuple[Any, ...]) -> _InstanceState:
        """Allocates static buffers and captures every (graph segment, bucket), largest bucket first."""
        program = self.program
        state = _InstanceState(
            executor=make_executor(self.graph_mode, self.config.debug),
            module_state=tuple(args[i] for i in (*self._state_slots, *self._scalar_slots)),
        )
        self._states[key] = state  # kept even when capture fails: later calls see state.failed
        state.input_buffers = {s: allocate(spec) for s, spec in program.input_buffers.items()}
        state.bridge_buffers = {s: allocate(spec) for s, spec in program.bridge_buffers.items()}
        env = self._env(args, self.num_tokens(args))
        graph_steps = [st for st in program.steps if st.segment.is_graph]
        start = time.perf_counter()
        try:
            with torch.no_grad(), state.executor.capture_session():
                for b in sorted(self.plan.sizes, reverse=True):
                    env[self.token_symbol] = b
                    table: list[Any] = [None] * program.num_slots
                    for i in (*self._state_slots, *self._scalar_slots):
                        table[i] = args[i]
                    for s, buf in (*state.input_buffers.items(), *state.bridge_buffers.items()):
                        table[s] = narrow_to(buf, program.token_dims.get(s, ()), env)
                    for st in graph_steps:
                        sargs = [table[r.slot] if r.size is None else r.size(env) for r in st.args]
                        try:
                            outs = state.executor.capture((st.index, b), st.fn, sargs)
                        except Exception as e:
                            raise RuntimeError(
                                f"pp_breakable: capturing segment {st.segment.name} of {self.name} for "
                                f"bucket {b} failed: {type(e).__name__}: {e}"
                            ) from e
                        counters.captures += 1
                        for s, o in zip(st.out_slots, outs):
                            if s >= 0:
                                table[s] = o
                    state.tables[b] = table
        except BaseException as e:
            state.failed = f"{type(e).__name__}: {e}"
            state.tables.clear()
            state.executor.release()
            raise
        log.info("%s: captured %d graphs (%d segments x %d buckets, %s) in %.2f s", self.name,
                 len(graph_steps) * len(self.plan.sizes), len(graph_steps), len(self.plan.sizes),
                 self.graph_mode, time.perf_counter() - start)
        return state

    # ----------------------------------------------------------------------------------- reports
    def describe(self) -> str:
        """A short human-readable summary: segments, breaks and their reasons, buckets."""
        lines = [f"{self.name}: {len(self.segments)} segments, graph mode {self.graph_mode}, "
                 f"buckets {len(self.plan.sizes)} up to {self.plan.cap}"]
        if self.eager_reason:
            lines.append(f"  always eager: {self.eager_reason}")
        for seg in self.segments:
            what = "graph" if seg.is_graph else f"break  {seg.reason}"
            lines.append(f"  {seg.name:<12} {seg.num_nodes:>4} nodes  {what}")
        return "\n".join(lines)

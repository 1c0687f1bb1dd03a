"""What a ``StageRuntime`` tells about itself: summary, captures, memory, generated code.

These methods read the compiled stage and the runtime's public state (``instances()``) and never serve a
call; ``StageRuntime`` inherits them from :class:`StageInspection`, so they are called on the runtime
(which itself holds ``instances()``, ``capture_records()`` and ``instrumented(wrap)``)::

    print(runtime.describe())              # segments, break reasons, buckets
    runtime.captured_buckets()             # {0: (256, 128, ...)} per module instance
    runtime.generated_code()               # the live path and each instance's bound graph path
"""

from __future__ import annotations

import sympy
import torch

from ppcompile.config import PPBreakableConfig
from ppcompile.records import BreakReason, Segment
from ppcompile.runtime.buckets import BucketPlan
from ppcompile.runtime.codegen import LiveForward
from ppcompile.runtime.compiled_stage import CompiledStage
from ppcompile.runtime.executors import EXECUTORS
from ppcompile.runtime.graph_codegen import graph_forward_source, replay_passes_args
from ppcompile.runtime.instance import StageInstance
from ppcompile.runtime.program import Program
from ppcompile.runtime.sibling_graphs import StaticCalls
from ppcompile.runtime.token_counts import TokenCounts
from ppcompile.runtime.whole_stage import describe_plan

__all__ = ["StageInspection"]


class StageInspection:
    """What a ``StageRuntime`` tells about itself (a mixin: it reads the compiled stage and the instances
    the runtime serves, through the runtime's public API only)."""

    compiled: CompiledStage
    config: PPBreakableConfig
    live_forward: LiveForward
    served_by: StaticCalls | None
    token_counts: TokenCounts

    # The compiled stage's facts, by the names the public API has always used on the runtime.
    @property
    def name(self) -> str:
        return self.compiled.name

    @property
    def program(self) -> Program:
        return self.compiled.program

    @property
    def plan(self) -> BucketPlan:
        return self.compiled.plan

    @property
    def graph_mode(self) -> str:
        return self.compiled.graph_mode

    @property
    def segments(self) -> tuple[Segment, ...]:
        return self.compiled.segments

    @property
    def break_reasons(self) -> list[BreakReason]:
        return self.compiled.break_reasons

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.compiled.layer_ids

    @property
    def token_symbol(self) -> sympy.Symbol | None:
        return self.compiled.token_symbol

    @property
    def eager_reason(self) -> str | None:
        return self.compiled.eager_reason

    @property
    def split_module(self) -> torch.fx.GraphModule | None:
        return self.compiled.record.split_module

    def instances(self) -> tuple[StageInstance, ...]:
        """The captured state of each module instance served so far (``StageRuntime``)."""
        raise NotImplementedError

    def fall_offs(self) -> dict[str, str]:
        """Why forwards stopped reaching the graph path, by cause (``StageRuntime``)."""
        raise NotImplementedError

    def static_bytes(self) -> int:
        """Bytes of static memory this runtime holds over all module instances: static input buffers,
        bridges and captured graph outputs (each storage counted once). On CUDA, graph-private
        intermediates in the pool come on top (see ``torch.cuda.memory_reserved``)."""
        sizes: dict[int, int] = {}
        for state in self.instances():
            for t in state.static_tensors():
                storage = t.untyped_storage()
                sizes[storage.data_ptr()] = storage.nbytes()
        return sum(sizes.values())

    def captured_buckets(self) -> dict[int, tuple[int, ...]]:
        """Per module instance (in order of first call), the buckets captured so far."""
        return {i: state.captured_buckets for i, state in enumerate(self.instances())}

    def graph_path_source(self) -> str | None:
        """The generated source of the graph path this stage's graph mode uses (``graph_codegen.py``), as
        an instance would bind it, or None without a graph path (what the debug dumps show)."""
        executor = EXECUTORS.get(self.graph_mode)
        if executor is None or self.token_symbol is None:
            return None
        pass_args = replay_passes_args(executor.binds_inputs, self.config.debug)
        return graph_forward_source(self.program, self.token_symbol, executor.binds_inputs, pass_args)[0]

    def generated_code(self) -> dict[str, str]:
        """The per-call code generated for this stage: the live path, and the graph paths built so far."""
        code = {"live": str(getattr(self.live_forward, "source", ""))}
        for state in self.instances():
            path = state.forward
            code.setdefault(f"graph ({path.describe()})", str(getattr(path.code, "source", "")))
        return code

    @property
    def label(self) -> str:
        """The stage graph's name (Dynamo's compile id), with the module instance it serves when that is
        not the frame's first module, and what it recompiles: ``stage_graph_0_2 (recompile of
        stage_graph_0_0)``, ``stage_graph_0_1 (module 2 of its frame)``."""
        record = self.compiled.record
        if record.recompile_of is not None:
            return f"{self.compiled.name} (recompile of {record.recompile_of})"
        if record.module is not None and record.module > 1:
            return f"{self.compiled.name} (module {record.module} of its frame)"
        return self.compiled.name

    def token_source(self) -> str:
        """Where a call's token count comes from, for messages."""
        if self.compiled.token_slot is not None:
            symbol = self.compiled.token_symbol
            return f"the size argument {symbol} (Dynamo reads it from an input's token dim)"
        if self.compiled.token_input is None:
            return "no input"
        i, d = self.compiled.token_input
        spec = next((s for s in self.compiled.input_specs if s.slot == i), None)
        return f"dim {d} of input {spec.name if spec else i!r}"

    def describe(self) -> str:
        """A short human-readable summary: segments, breaks and their reasons, buckets."""
        c = self.compiled
        lines = [f"{self.label}: {len(c.segments)} segments, graph mode {c.graph_mode}, "
                 f"buckets {len(c.plan.sizes)} up to {c.plan.cap}"]
        if c.record.frame_compile is not None:
            lines.append(f"  recompile budget: compile {c.record.frame_compile} of its frame, Dynamo's limit "
                         f"{c.record.recompile_limit}")
        if c.record.recompile_reason:
            lines.append("  recompiled: these guards failed, each with the source line that added it (the "
                         "counts it tells apart get stage graphs of their own):")
            lines += [f"    {line}" for line in c.record.recompile_reason.splitlines()]
        if c.merged_token_dims:
            lines.append(f"  {self.token_counts.describe()}")
        if c.record.input_changes:
            lines.append("  inputs differ in structure from the earlier calls' of its module (a bad input?):")
            lines += [f"    {change}" for change in c.record.input_changes]
        if c.record.region_traces:
            lines.append(f"  nested regions: {sum(c.record.region_traces.values())} calls served by "
                         f"{len(c.record.region_traces)} traced subgraph(s)")
        if c.record.stamped_layers:
            lines.append(f"  stamped layers: {c.record.stamped_layers} (each one op in Dynamo's trace, "
                         "expanded from its group's first layer)")
        for layer, why in c.record.traced_flat.items():
            lines.append(f"  traced flat, not stamped: {layer}: {why}")
        if self.served_by is not None:
            lines.append(f"  static sizes: its calls are served by {self.served_by.by}'s buckets")
        elif c.eager_reason:
            lines.append(f"  always eager: {c.eager_reason}")
        for cause, message in self.fall_offs().items():
            lines.append(f"  fell off the graph path ({cause}): {message}")
        if c.whole is not None or c.whole_reason:
            lines.append(f"  {describe_plan(c.whole, c.whole_reason, c.plan.sizes)}")
        for seg in c.segments:
            graph = "graph" if c.eager_reason is None else "graph segment, run eagerly (always eager)"
            what = graph if seg.is_graph else f"break  {seg.reason}"
            declared = seg.token_local_regions
            regions = f"  [token-local: {', '.join(declared)}]" if declared else ""
            lines.append(f"  {seg.name:<12} {seg.num_nodes:>4} nodes  {what}{regions}")
        return "\n".join(lines)

"""``CompiledStage``: what the compile side hands the runtime, frozen (built by ``lowering.lower_stage``)."""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Mapping

import sympy
import torch

from ppcompile.records import BreakReason, Collective, Segment, SegmentCompile
from ppcompile.runtime.buckets import BucketPlan
from ppcompile.runtime.layout_checks import CheckedValue
from ppcompile.runtime.program import Program
from ppcompile.runtime.validation import InputSpec
from ppcompile.runtime.whole_stage import WholeStagePlan

__all__ = ["CompileRecord", "CompiledStage"]


_EMPTY_COUNTS: Mapping[str, int] = types.MappingProxyType({})
_EMPTY_REASONS: Mapping[str, str] = types.MappingProxyType({})
_EMPTY: Mapping[str, float] = types.MappingProxyType({})


@dataclasses.dataclass(frozen=True)
class CompileRecord:
    """How the stage was compiled, for reports, dumps and diagnoses (never read on the hot path): the
    split module after the passes, seconds per pass and per phase, how each graph segment got its
    callable, and Dynamo's compile id."""

    split_module: torch.fx.GraphModule | None = None
    pass_times: Mapping[str, float] = dataclasses.field(default_factory=lambda: _EMPTY)
    # Seconds by phase: dynamo_trace, passes, pass.<name>, segment_compile.
    compile_times: Mapping[str, float] = dataclasses.field(default_factory=lambda: _EMPTY)
    segment_compiles: tuple[SegmentCompile, ...] = ()
    compile_id: object | None = None  # Dynamo's CompileId, for TORCH_TRACE artifacts
    # The recompile budget: which compile of its frame this is (1 for the first) and Dynamo's limit.
    frame_compile: int | None = None
    recompile_limit: int | None = None
    # Which module instance of its frame it serves (1 for the first; by the parameters and buffers it
    # reads; None for a stage graph that reads none), and the stage graph it recompiles for that module.
    module: int | None = None
    recompile_of: str | None = None
    recompile_reason: str | None = None  # the guards that failed, with the source lines that added them
    # How a recompile's inputs differ in structure from the module's first symbolic stage graph's (a key
    # gone or new, a dtype, device or rank): most likely a bad input (``sibling_graphs.input_changes``).
    input_changes: tuple[str, ...] = ()
    # Nested compile regions (``trace_layers_once``): subgraph -> the calls it served. Fewer subgraphs
    # than calls is what tracing once saved; one subgraph per call means torch traced every call.
    region_traces: Mapping[str, int] = dataclasses.field(default_factory=lambda: _EMPTY_COUNTS)
    stamped_layers: int = 0  # layers stamped from an exemplar (``trace_layers_once``)
    # The layers of stamped groups whose check failed, traced flat: layer name -> why.
    traced_flat: Mapping[str, str] = dataclasses.field(default_factory=lambda: _EMPTY_REASONS)


@dataclasses.dataclass(frozen=True)
class CompiledStage:
    """One compiled stage graph, as the runtime serves it (read-only)."""

    name: str
    graph_mode: str
    program: Program
    plan: BucketPlan
    segments: tuple[Segment, ...]
    layer_ids: tuple[int, ...]
    token_symbol: sympy.Symbol | None
    token_input: tuple[int, int] | None  # (input, dim) carrying the token count
    symbol_slots: tuple[tuple[int, sympy.Symbol], ...]  # inputs that are a bare symbol's value
    state_slots: tuple[int, ...]  # parameters and buffers: graphs are keyed by them
    scalar_slots: tuple[int, ...]  # module attributes passed as 0-d tensors: baked into graphs
    tensor_slots: tuple[int, ...]  # live tensor inputs
    input_specs: tuple[InputSpec, ...]  # what graph-path calls check before copying in
    live_checks: tuple[CheckedValue, ...]  # what the live path checks (segments without size asserts)
    eager_reason: str | None  # why every forward runs eagerly, or None
    # The eager reason is no policy but a fall-off: the graph's shape guards refuse every capture size.
    never_graphs: bool = False
    # The collectives the stage graph calls (``find_collectives``): its ranks must decide alike.
    collectives: tuple[Collective, ...] = ()
    # Stamped layers' weights: inputs of the stage graph that Dynamo does not pass; appended to each call's.
    bound_inputs: tuple[torch.Tensor, ...] = ()
    # The graph's placeholder names, by input (Dynamo's names for their sources; () when not known).
    input_names: tuple[str, ...] = ()
    # (input, dim, Dynamo's symbol) of live inputs whose token dim had a symbol of its own, merged into
    # the token symbol (marked dynamic one by one): each call checks they hold the token count.
    merged_token_dims: tuple[tuple[int, int, str], ...] = ()
    # Whole-stage graphs (``whole_stage.py``): the plan, or None and why not (None: nothing to gain).
    whole: WholeStagePlan | None = None
    whole_reason: str | None = None
    record: CompileRecord = dataclasses.field(default_factory=lambda: CompileRecord())

    @property
    def break_reasons(self) -> list[BreakReason]:
        return [s.reason for s in self.segments if s.reason is not None]

    @functools.cached_property
    def token_slot(self) -> int | None:
        """The input that is the token count itself (a size argument), if any."""
        return next((i for i, e in self.symbol_slots if e == self.token_symbol), None)

"""``CompiledStage``: what the compile side hands the runtime, frozen (built by ``lowering.lower_stage``)."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any

import sympy
import torch

from ppcompile.records import BreakReason, Segment
from ppcompile.runtime.buckets import BucketPlan
from ppcompile.runtime.layout_checks import CheckedValue
from ppcompile.runtime.program import Program
from ppcompile.runtime.validation import InputSpec

__all__ = ["CompiledStage"]


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
    split_module: torch.fx.GraphModule
    segment_compiles: tuple[Any, ...] = ()
    compile_times: Mapping[str, float] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))

    @property
    def break_reasons(self) -> list[BreakReason]:
        return [s.reason for s in self.segments if s.reason is not None]

    @property
    def token_slot(self) -> int | None:
        """The input that is the token count itself (a size argument), if any."""
        return next((i for i, e in self.symbol_slots if e == self.token_symbol), None)

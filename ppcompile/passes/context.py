"""What the passes share: the config, the example inputs, and the facts each pass establishes."""

from __future__ import annotations

import dataclasses
from typing import Any

import sympy
import torch

from ppcompile.config import PPBreakableConfig
from ppcompile.records import Collective, InputKind, StaticBuffer

__all__ = ["PassContext", "PassResult", "StaticInputPlan"]


@dataclasses.dataclass(frozen=True)
class PassResult:
    """What a pass returns: the (possibly new) graph module and whether it changed the graph."""

    graph_module: torch.fx.GraphModule
    modified: bool


@dataclasses.dataclass(frozen=True)
class StaticInputPlan:
    """A top-level input that graph segments read, lifted into a static buffer."""

    input_index: int
    buffer: StaticBuffer
    size_exprs: tuple[sympy.Expr, ...]  # the input's shape in terms of the symbols


@dataclasses.dataclass
class PassContext:
    """Facts established by the passes, in the order they run.

    ``inline_nested_regions`` fills ``region_traces``; ``expand_stamped_layers`` fills ``stamped_layers``,
    ``traced_flat`` and ``bound_inputs`` (stamped layers' weights: graph inputs the runtime appends to each
    call's);
    ``find_token_dims`` fills ``token_symbol``, ``input_kinds``, ``token_input``, ``merged_token_dims`` and
    ``token_guards``;
    ``find_declared_regions`` fills ``token_local_regions``; ``find_collectives`` fills ``collectives``;
    ``align_global_layers`` fills ``layer_ids`` and ``eligible``; ``lift_static_inputs`` fills
    ``static_inputs``. Facts about single nodes (token dims, break verdicts, segments, static buffers and
    bridges) live on the nodes: ``analysis.node_facts`` (``segments(split)`` lists the segments).
    Outputs are trimmed by their token dims, which ``lowering.build_program`` reads.
    """

    config: PPBreakableConfig
    example_inputs: list[Any]
    graph_name: str = "stage"
    token_symbol: sympy.Symbol | None = None
    input_kinds: list[InputKind] = dataclasses.field(default_factory=list)
    token_input: tuple[int, int] | None = None  # (input index, dim) that carries the token count
    # (input index, dim, Dynamo's symbol) of the inputs whose token dim had a symbol of its own, merged
    # into the token symbol (marked dynamic one by one, equal at the traced call): checked per call.
    merged_token_dims: tuple[tuple[int, int, str], ...] = ()
    symint_inputs: dict[int, sympy.Expr] = dataclasses.field(default_factory=dict)
    other_symbols: frozenset[sympy.Symbol] = frozenset()
    token_local_regions: tuple[str, ...] = ()
    collectives: tuple[Collective, ...] = ()  # the collective ops the graph calls, in graph order
    token_guards: tuple[sympy.Basic, ...] = ()  # Dynamo's shape guards on the token symbol alone
    layer_ids: tuple[int, ...] = ()
    eligible: bool = True
    ineligible_reason: str | None = None
    static_inputs: list[StaticInputPlan] = dataclasses.field(default_factory=list)
    region_traces: dict[str, int] = dataclasses.field(default_factory=dict)  # subgraph -> calls it served
    stamped_layers: int = 0  # layers expand_stamped_layers copied from an exemplar
    traced_flat: dict[str, str] = dataclasses.field(default_factory=dict)  # stamping refused: layer -> why
    bound_inputs: list[torch.Tensor] = dataclasses.field(default_factory=list)  # appended inputs, in order
    pass_times: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def is_static(self) -> bool:
        """True when the graph has no token symbol (Dynamo traced it with concrete sizes)."""
        return self.token_symbol is None

"""Tests of ``align_global_layers``: attention calls <-> global layer ids, and stage eligibility."""

from __future__ import annotations

import pytest
import torch
from attention_modules import Attn, attention_context
from fx_helpers import dynamo_graph, make_ctx

from ppcompile.analysis.node_facts import LAYER_ID
from ppcompile.passes.align_global_layers import align_global_layers
from ppcompile.passes.find_token_dims import find_token_dims


def _align(layer_ids: tuple[int, ...]):  # type: ignore[no-untyped-def]
    x = torch.randn(6, 8)
    with attention_context(6, set(layer_ids)):
        gm, ex = dynamo_graph(Attn(layer_ids), x)
    ctx = make_ctx(gm, ex)
    find_token_dims(gm, ctx)
    return gm, ctx


def _attention_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target is torch.ops.ppcompile.attention]


def test_contiguous_global_ids_are_eligible() -> None:
    gm, ctx = _align((4, 5, 6))
    result = align_global_layers(gm, ctx)
    assert result.graph_module is gm and not result.modified
    assert ctx.layer_ids == (4, 5, 6)
    assert ctx.eligible and ctx.ineligible_reason is None
    assert [LAYER_ID.get(n) for n in _attention_nodes(gm)] == [4, 5, 6]
    assert all(not LAYER_ID.has(n) for n in gm.graph.nodes if n not in _attention_nodes(gm))


def test_ids_are_recorded_sorted_and_out_of_order_calls_keep_their_own_id() -> None:
    gm, ctx = _align((6, 4, 5))
    align_global_layers(gm, ctx)
    assert ctx.layer_ids == (4, 5, 6) and ctx.eligible
    assert [LAYER_ID.get(n) for n in _attention_nodes(gm)] == [6, 4, 5]


def test_duplicate_ids_raise_naming_the_id() -> None:
    gm, ctx = _align((4, 5, 5))
    with pytest.raises(ValueError, match=r"global layer id 5 is used by two attention calls"):
        align_global_layers(gm, ctx)


def test_gap_makes_the_stage_ineligible_naming_the_missing_layer() -> None:
    gm, ctx = _align((4, 6))
    align_global_layers(gm, ctx)
    assert ctx.layer_ids == (4, 6)
    assert not ctx.eligible
    assert ctx.ineligible_reason is not None and "[5]" in ctx.ineligible_reason


def test_stage_without_attention_has_no_layers_and_stays_eligible() -> None:
    gm, ex = dynamo_graph(torch.nn.Linear(8, 8), torch.randn(6, 8))
    ctx = make_ctx(gm, ex)
    align_global_layers(gm, ctx)
    assert ctx.layer_ids == () and ctx.eligible


def test_layer_id_passed_by_keyword() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        q = x.view(-1, 2, 4)
        return torch.ops.ppcompile.attention(q, q, q, layer_id=7)

    with attention_context(6, [7]):
        gm, ex = dynamo_graph(f, torch.randn(6, 8))
    ctx = make_ctx(gm, ex)
    align_global_layers(gm, ctx)
    assert ctx.layer_ids == (7,)
    assert [LAYER_ID.get(n) for n in _attention_nodes(gm)] == [7]

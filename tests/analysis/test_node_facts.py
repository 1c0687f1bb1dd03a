"""``node_facts``: each fact the passes record on FX nodes, under one meta key, read back with its type."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import sympy
import torch

from ppcompile.analysis.node_facts import (
    BOUND_WEIGHT,
    BREAK_CAUSE,
    CAPTURE_UNSAFE,
    COLLECTIVE,
    EAGER_REGION,
    FACTS,
    LAYER_ID,
    PADDING_UNSAFE,
    SEGMENT,
    SIZE_EXPR,
    STATIC_BUFFER,
    TOKEN_DIMS,
    TOKEN_LOCAL,
    WRITTEN_ARGS,
    NodeFact,
    token_dim_sizes,
    token_dims,
)
from ppcompile.records import BreakKind, BreakReason, Collective, Segment, StaticBuffer

PACKAGE = Path(__file__).resolve().parents[2] / "ppcompile"
s0 = sympy.Symbol("s0", integer=True, positive=True)
SAMPLES: list[tuple[NodeFact[Any], Any]] = [
    (BOUND_WEIGHT, "layers.5.mlp.down_proj.weight"),
    (TOKEN_DIMS, ((0, s0), (2, s0 // 2))),
    (SIZE_EXPR, s0 // 2),
    (LAYER_ID, 7),
    (TOKEN_LOCAL, "layers.0.mlp (mymodel.Moe)"),
    (EAGER_REGION, "mymodel.chunked_scan"),
    (COLLECTIVE, Collective("all_reduce", "0")),
    (PADDING_UNSAFE, "Tensor.mean reduces along the token dim"),
    (CAPTURE_UNSAFE, "its implementation reads a device value on the host (a sync)"),
    (BREAK_CAUSE, BreakReason(BreakKind.ATTENTION, "ppcompile.attention.default", "global layer 3")),
    (SEGMENT, Segment("submod_1", "break", 3)),
    (STATIC_BUFFER, StaticBuffer("l_x_", "input", (64, 8), torch.float32, torch.device("cpu"), (0,))),
    (WRITTEN_ARGS, (0, 2)),
]


def _node() -> torch.fx.Node:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    return graph.call_function(torch.relu, (x,))


def test_every_fact_has_a_sample() -> None:
    assert [fact for fact, _ in SAMPLES] == list(FACTS)


@pytest.mark.parametrize(("fact", "value"), SAMPLES, ids=[f.key for f, _ in SAMPLES])
def test_round_trip(fact: NodeFact[Any], value: Any) -> None:
    node = _node()
    fact.set(node, value)
    assert fact.has(node) and fact.get(node) == value and fact.of(node) == value
    assert node.meta[fact.key] == value  # what a reader of the raw key (lowering) sees
    assert all(not other.has(node) for other in FACTS if other is not fact)


@pytest.mark.parametrize("fact", FACTS, ids=[f.key for f in FACTS])
def test_a_missing_fact(fact: NodeFact[Any]) -> None:
    node = _node()
    assert not fact.has(node) and fact.get(node) is None
    with pytest.raises(KeyError, match=f"node relu has no meta\\['{fact.key}'\\]; {fact.writer} sets it"):
        fact.of(node)


def test_token_dims_default_to_empty() -> None:
    node = _node()
    assert token_dims(node) == () and token_dim_sizes(node) == {}
    assert token_dims(3) == () and token_dim_sizes(None) == {}  # an argument that is no node
    TOKEN_DIMS.set(node, ((0, s0), (1, 2 * s0)))
    assert token_dims(node) == ((0, s0), (1, 2 * s0)) and token_dim_sizes(node) == {0: s0, 1: 2 * s0}
    TOKEN_DIMS.set(node, ())  # a tensor without token dims (a parameter) has the fact, empty
    assert TOKEN_DIMS.has(node) and token_dims(node) == ()


def test_each_key_and_its_writer() -> None:
    """The keys are what dumps show in node meta, and each names the pass that writes it."""
    assert {f.key: f.writer for f in FACTS} == {
        "pp_bound_weight": "expand_stamped_layers",
        "pp_token_dims": "find_token_dims",
        "pp_size_expr": "find_token_dims",
        "pp_layer_id": "align_global_layers",
        "pp_token_local": "find_declared_regions",
        "pp_eager_region": "find_declared_regions",
        "pp_collective": "find_collectives",
        "pp_unsafe": "check_padding_safety",
        "pp_capture_unsafe": "check_capture_safety",
        "pp_break_cause": "split_at_breaks",
        "pp_segment": "split_at_breaks",
        "pp_static_buffer": "lift_static_inputs",
        "pp_written_args": "lift_static_inputs",
    }


# Files that may spell a fact's key: node_facts itself; tracing/regions.py, whose ANNOTATION_KEY is the same
# string in another dict (meta["custom"]).
KEYS_SPELLED_IN = {"analysis/node_facts.py", "tracing/regions.py"}


def test_the_keys_are_spelled_only_in_node_facts() -> None:
    keys = {f.key for f in FACTS}
    found = set()
    for path in PACKAGE.rglob("*.py"):
        name = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in keys and name not in KEYS_SPELLED_IN:
                found.add((name, node.lineno, node.value))
    assert not found, sorted(found)

"""``op_matching``: ops matched as overload and packet; one name for a node's op, for rules and messages."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch

from ppcompile.analysis.op_matching import OpMatcher, op_name


def _node(op: str, target: Any) -> torch.fx.Node:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    return graph.create_node(op, target, (x,))


@pytest.mark.parametrize(("op", "target", "plain", "qualified"), [
    ("call_method", "mean", "mean", "mean"),
    ("call_function", torch.relu, "relu", "relu"),
    ("call_function", operator.getitem, "getitem", "getitem"),
    ("call_function", torch.ops.aten.view.default, "view.default", "aten.view.default"),
    ("call_function", torch.ops.aten.view, "view", "aten.view"),
])
def test_op_name_plain_and_qualified(op: str, target: Any, plain: str, qualified: str) -> None:
    node = _node(op, target)
    assert (op_name(node), op_name(node, qualified=True)) == (plain, qualified)


def test_a_packet_matches_every_overload_and_an_overload_its_packet() -> None:
    by_packet, by_overload = OpMatcher([torch.ops.aten.add]), OpMatcher(["aten::add"])
    for target in (torch.ops.aten.add.Tensor, torch.ops.aten.add.Scalar, torch.ops.aten.add):
        assert by_packet.matches(_node("call_function", target))
        assert by_overload.matches(_node("call_function", target))
    assert not by_packet.matches(_node("call_function", torch.ops.aten.sub.Tensor))
    assert not by_packet.matches(_node("call_method", "add"))  # methods are matched by rules, not here

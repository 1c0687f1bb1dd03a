"""``analysis/ordered_split.py``: the split of a graph into partitions in graph order is the module
``torch.fx.passes.split_module(..., keep_original_order=True)`` makes, code, names and meta alike, and
graphs it does not serve are left to ``split_module``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from fx_helpers import dynamo_graph
from torch.fx.passes.split_module import split_module

from ppcompile.analysis.ordered_split import split_in_order

Node = torch.fx.Node


def _layers(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Two attention-split layers whose values carry the token count across every cut, a reshape by
    a size read inside, and an input handed straight to the output."""
    h = torch.nn.functional.linear(x, w)
    for _ in range(2):
        a = torch.nn.functional.scaled_dot_product_attention(h[None], h[None], h[None])[0]
        h = (torch.relu(a) + h).reshape(x.shape[0], -1)
    return h * 2, x, x.shape[0] + 1


class _WithConstant(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.sin(x) * self.scale
        return torch.cos(y) + self.scale


def _at_attention(gm: torch.fx.GraphModule) -> dict[Node, int]:
    """Partitions in graph order: each attention call one of its own."""
    part, out = 0, {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if "attention" in str(node.target):
            part += 1
            out[node] = part
            part += 1
            continue
        out[node] = part
    return out


def _every_op(gm: torch.fx.GraphModule) -> dict[Node, int]:
    calls = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    return {n: i for i, n in enumerate(calls)}


def _assert_same(ours: torch.fx.GraphModule, theirs: torch.fx.GraphModule) -> None:
    assert ours.code == theirs.code
    for a, b in zip(ours.graph.nodes, theirs.graph.nodes, strict=True):
        assert (a.name, a.op, a.target, a.meta.keys()) == (b.name, b.op, b.target, b.meta.keys())
    mine, other = dict(ours.named_children()), dict(theirs.named_children())
    assert list(mine) == list(other)
    for name, sub in mine.items():
        assert sub.code == other[name].code, name
        for a, b in zip(sub.graph.nodes, other[name].graph.nodes, strict=True):
            assert (a.name, a.meta.keys()) == (b.name, b.meta.keys()), name
            assert a.meta.get("example_value") is b.meta.get("example_value"), name


@pytest.mark.parametrize(("model", "args", "partition_of"), [
    (_layers, (torch.randn(6, 8), torch.randn(8, 8)), _at_attention),
    (_layers, (torch.randn(6, 8), torch.randn(8, 8)), _every_op),
    (_WithConstant(), (torch.randn(5, 8),), _every_op),
])
def test_the_split_is_split_modules(model: Callable[..., Any], args: tuple[torch.Tensor, ...],
                                     partition_of: Callable[[torch.fx.GraphModule], dict[Node, int]]) -> None:
    gm, inputs = dynamo_graph(model, *args)
    partition = partition_of(gm)
    ours = split_in_order(gm, partition)
    assert ours is not None
    theirs = split_module(gm, gm, lambda n: partition[n], keep_original_order=True)
    _assert_same(ours, theirs)
    with torch.no_grad():
        concrete = [int(v) if isinstance(v, torch.SymInt) else v for v in inputs]
        torch.testing.assert_close(ours(*concrete), theirs(*concrete))


def test_partitions_out_of_graph_order_are_left_to_split_module() -> None:
    gm, _ = dynamo_graph(_layers, torch.randn(6, 8), torch.randn(8, 8))
    partition = _every_op(gm)
    first, second = list(partition)[:2]
    partition[first], partition[second] = partition[second], partition[first]
    assert split_in_order(gm, partition) is None


def test_a_grad_mode_switch_is_left_to_split_module() -> None:
    def switched(x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            y = x * 2
        return y + 1

    gm, _ = dynamo_graph(switched, torch.randn(4, 8))
    assert any(n.target is torch._C._set_grad_enabled for n in gm.graph.nodes)
    assert split_in_order(gm, _every_op(gm)) is None

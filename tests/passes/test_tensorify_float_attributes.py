"""``tensorify_float_attributes``: under Inductor segments ``x op attr.item()`` becomes ``x op attr`` where
the result dtype cannot change; any other use of a float attribute makes Dynamo re-trace with it as a
constant."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from fx_helpers import make_ctx

from ppcompile.passes.tensorify_float_attributes import tensorify_float_attributes

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # Dynamo remembers the floats it was asked to specialise


class _Scaled(torch.nn.Module):
    def __init__(self, body: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.scale = 0.5
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self, x)


def _run(gm: torch.fx.GraphModule, example_inputs: list[Any], segment_compiler: str = "inductor") -> bool:
    ctx = make_ctx(gm, example_inputs, segment_compiler=segment_compiler)
    return tensorify_float_attributes(gm, ctx).modified


def _trace(body: Callable[[Any, torch.Tensor], torch.Tensor], x: torch.Tensor) -> list[tuple[Any, ...]]:
    """Runs ``tensorify_float_attributes`` as a backend; one record per backend call: (modified or
    "restart", float inputs left, the graph's ``item`` calls left). Checks the result against eager."""
    calls: list[tuple[Any, ...]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        floats = [p.name for p in gm.graph.find_nodes(op="placeholder") if "scale" in p.name]
        try:
            modified: Any = _run(gm, example_inputs)
        except torch._dynamo.exc.RestartAnalysis:
            calls.append(("restart", floats, None))
            raise
        items = len(gm.graph.find_nodes(op="call_method", target="item"))
        calls.append((modified, floats, items))
        return gm.forward

    module = _Scaled(body)
    compiled = torch.compile(module, backend=backend, dynamic=True, fullgraph=True)
    torch.testing.assert_close(compiled(x), module(x))
    return calls


X = torch.randn(6, 4)


@pytest.mark.parametrize("body", [
    lambda m, x: x * m.scale,
    lambda m, x: m.scale + x.float(),
    lambda m, x: torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.scale),
])
def test_arithmetic_with_a_float_tensor_keeps_the_attribute_an_input(body: Any) -> None:
    assert _trace(body, X) == [(True, ["l_self_scale"], 0)]


@pytest.mark.parametrize("body", [
    lambda m, x: x.clamp(max=m.scale),  # a keyword of another op
    lambda m, x: x * (m.scale * 2),  # float arithmetic first
    lambda m, x: torch.arange(x.shape[0]).unsqueeze(1) + m.scale + x,  # int tensor: dtype would change
])
def test_other_uses_restart_dynamo_with_the_float_as_a_constant(body: Any) -> None:
    calls = _trace(body, X)
    assert calls[0] == ("restart", ["l_self_scale"], None)
    assert calls[1:] == [(False, [], 0)]


def test_concrete_graphs_are_left_alone() -> None:
    module = _Scaled(lambda m, x: x.clamp(max=m.scale))
    seen = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        floats = [p.name for p in gm.graph.find_nodes(op="placeholder") if "scale" in p.name]
        seen.append((_run(gm, example_inputs), floats))
        return gm.forward

    torch.compile(module, backend=backend, dynamic=True)(torch.randn(1, 1))  # sizes 0 and 1 are static
    assert seen == [(False, ["l_self_scale"])]  # an input used by clamp, no restart: segments run eagerly


def test_eager_segments_are_left_alone() -> None:
    """Eager segments run ``.item()`` as is: no rewrite, and no re-trace for other uses."""
    module = _Scaled(lambda m, x: x.clamp(max=m.scale) * m.scale)
    seen = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        items = len(gm.graph.find_nodes(op="call_method", target="item"))
        seen.append((_run(gm, example_inputs, "eager"), items))
        return gm.forward

    torch.compile(module, backend=backend, dynamic=True)(X)
    assert len(seen) == 1 and seen[0][0] is False and seen[0][1] > 0  # one backend call, items kept

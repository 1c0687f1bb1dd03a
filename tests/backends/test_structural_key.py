"""``structural_key``: equal for segments that differ only in names and symbol numbering; different
for any change in code, constants, input metadata, input roles or compiler options."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from fx_helpers import scaler
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from ppcompile.backends.structural_key import structural_key

OPTIONS = {"compiler": "inductor", "compile_sizes": ()}
KINDS = ["tensor", "module state"]


def _fakes(shapes: list[tuple[int, ...]], dynamic_dim0: list[bool], skip: int = 0,
           dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Fake tensors in a fresh shape env; ``skip`` dummy symbols first shift the symbol numbering."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    dyn = DimDynamic.DYNAMIC
    for i in range(skip):  # distinct hints so the dummies get symbols of their own
        mode.from_tensor(torch.empty(1000 + i), symbolic_context=StatelessSymbolicContext([dyn]))
    out = []
    for shape, dynamic in zip(shapes, dynamic_dim0):
        dims = [dyn if (d == 0 and dynamic) else DimDynamic.STATIC for d in range(len(shape))]
        out.append(mode.from_tensor(torch.empty(shape, dtype=dtype),
                                    symbolic_context=StatelessSymbolicContext(dims)))
    return out


def _graph(names: tuple[str, str], inputs: list[torch.Tensor],
           body: Callable[[torch.fx.Graph, torch.fx.Node, torch.fx.Node], Any]) -> torch.fx.GraphModule:
    """``body(x, w)`` over two placeholders named ``names`` whose traced values are ``inputs``."""
    graph = torch.fx.Graph()
    x = graph.placeholder(names[0])
    w = graph.placeholder(names[1])
    x.meta["example_value"], w.meta["example_value"] = inputs
    graph.output((body(graph, x, w),))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _linear_relu(graph: torch.fx.Graph, x: torch.fx.Node, w: torch.fx.Node) -> torch.fx.Node:
    return graph.call_function(torch.relu, (graph.call_function(F.linear, (x, w)),))


def _linear_scale(scale: float) -> Callable[..., torch.fx.Node]:
    def body(graph: torch.fx.Graph, x: torch.fx.Node, w: torch.fx.Node) -> torch.fx.Node:
        return graph.call_function(operator.mul, (graph.call_function(F.linear, (x, w)), scale))

    return body


def _key(gm: torch.fx.GraphModule, kinds: list[str] = KINDS, **options: Any) -> str:
    return structural_key(gm, kinds, {**OPTIONS, **options})


BASE_INPUTS = ([(8, 16), (32, 16)], [True, False])


def test_names_and_symbol_numbering_do_not_matter() -> None:
    layer2 = _graph(("l_layers_2_x", "l_layers_2_w"), _fakes(*BASE_INPUTS), _linear_relu)
    layer7 = _graph(("out_5", "l_layers_7_w"), _fakes(*BASE_INPUTS, skip=3), _linear_relu)
    x7 = layer7.graph.find_nodes(op="placeholder")[0].meta["example_value"]
    x2 = layer2.graph.find_nodes(op="placeholder")[0].meta["example_value"]
    assert str(x7.shape[0]) != str(x2.shape[0])  # the token symbols really are named differently
    assert _key(layer2) == _key(layer7)
    assert len(_key(layer2)) == 16


def _calls(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., torch.fx.Node]:
    def body(graph: torch.fx.Graph, x: torch.fx.Node, w: torch.fx.Node) -> torch.fx.Node:
        return graph.call_function(fn, (graph.call_function(F.linear, (x, w)),))

    return body


def test_two_closures_of_one_function_do_not_share_a_key() -> None:
    """A Python function a graph calls enters the key as itself; a C function by its name."""
    half, quarter = scaler(0.5), scaler(0.25)
    assert half.__qualname__ == quarter.__qualname__
    keys = [_key(_graph(("x", "w"), _fakes(*BASE_INPUTS), _calls(fn))) for fn in (half, quarter, half)]
    assert keys[0] != keys[1] and keys[0] == keys[2]
    assert _key(_graph(("x", "w"), _fakes(*BASE_INPUTS), _linear_relu)) \
        == _key(_graph(("a", "b"), _fakes(*BASE_INPUTS), _linear_relu))


@pytest.mark.parametrize("change", ["code", "constant", "dtype", "shape", "static dim", "roles", "options"])
def test_any_structural_change_changes_the_key(change: str) -> None:
    base = _graph(("x", "w"), _fakes(*BASE_INPUTS), _linear_scale(0.5))
    kinds = KINDS
    options: dict[str, Any] = {}
    inputs = _fakes(*BASE_INPUTS)
    body = _linear_scale(0.5)
    if change == "code":
        body = _linear_relu
    elif change == "constant":
        body = _linear_scale(0.25)
    elif change == "dtype":
        inputs = _fakes(*BASE_INPUTS, dtype=torch.bfloat16)
    elif change == "shape":
        inputs = _fakes([(8, 16), (64, 16)], BASE_INPUTS[1])
    elif change == "static dim":
        inputs = _fakes(BASE_INPUTS[0], [False, False])
    elif change == "roles":
        kinds = ["tensor", "tensor"]
    elif change == "options":
        options = {"compile_sizes": (16,)}
    other = _graph(("x", "w"), inputs, body)
    assert _key(base) != _key(other, kinds, **options)


def test_input_kinds_must_match_the_placeholders() -> None:
    gm = _graph(("x", "w"), _fakes(*BASE_INPUTS), _linear_relu)
    with pytest.raises(ValueError, match="1 input kinds for 2 inputs"):
        structural_key(gm, ["tensor"], OPTIONS)

"""Eager segments share the generated code of alike segments (``ppcompile.backends.eager_code``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from fx_helpers import scaler
from reference_runs import run_middle_stage
from stage_checks import assert_close

from ppcompile.backends.eager_code import EagerCode, program_of
from ppcompile.counters import counters
from ppcompile.models import REFERENCE_CONFIGS, make_stage


def _graph(build: Callable[[torch.fx.Graph, torch.fx.Node, torch.fx.Node], torch.fx.Node],
           names: tuple[str, str] = ("x", "w")) -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    x, w = g.placeholder(names[0]), g.placeholder(names[1])
    g.output(build(g, x, w))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _scaled(k: Any) -> Callable[[torch.fx.Graph, torch.fx.Node, torch.fx.Node], torch.fx.Node]:
    def build(g: torch.fx.Graph, x: torch.fx.Node, w: torch.fx.Node) -> torch.fx.Node:
        y = g.call_function(torch.matmul, (x, w))
        return g.call_function(torch.mul, (y, k))
    return build


def test_alike_graphs_share_one_forward_and_each_runs_on_its_own_inputs() -> None:
    code = EagerCode()
    first, second = _graph(_scaled(2)), _graph(_scaled(2), names=("out_1", "L_w3_"))
    with counters.expect(eager_code_reuses=1):
        f1, f2 = code.forward(first), code.forward(second)
    assert f1 is f2
    x, w = torch.randn(3, 4), torch.randn(4, 2)
    torch.testing.assert_close(f2(x, w), x @ w * 2)


@pytest.mark.parametrize(("a", "b"), [(2, 2.0), (1, True), (0.0, -0.0), (2, 3), ("sum", "mean")])
def test_constants_equal_only_as_python_values_do_not_share(a: Any, b: Any) -> None:
    assert program_of(_graph(_scaled(a))) != program_of(_graph(_scaled(b)))
    code = EagerCode()
    assert code.forward(_graph(_scaled(a))) is not code.forward(_graph(_scaled(b)))


def test_other_wiring_does_not_share() -> None:
    def swapped(g: torch.fx.Graph, x: torch.fx.Node, w: torch.fx.Node) -> torch.fx.Node:
        return _scaled(2)(g, w, x)

    assert program_of(_graph(_scaled(2))) != program_of(_graph(swapped))


def test_a_graph_that_reads_its_module_keeps_its_own_code() -> None:
    root = torch.nn.Module()
    root.register_buffer("scale", torch.tensor(3.0))
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.mul, (x, g.get_attr("scale"))))
    gm = torch.fx.GraphModule(root, g)
    assert program_of(gm) is None
    code = EagerCode()
    assert code.forward(gm) is not code.forward(torch.fx.GraphModule(root, g))


def _calls(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., torch.fx.Node]:
    def build(g: torch.fx.Graph, x: torch.fx.Node, w: torch.fx.Node) -> torch.fx.Node:
        return g.call_function(fn, (g.call_function(torch.matmul, (x, w)),))
    return build


def test_a_python_function_the_graph_calls_shares_only_with_itself() -> None:
    two, three = scaler(2.0), scaler(3.0)
    assert program_of(_graph(_calls(two))) == program_of(_graph(_calls(two)))
    code = EagerCode()
    f2, f3 = code.forward(_graph(_calls(two))), code.forward(_graph(_calls(three)))
    assert f2 is not f3
    x, w = torch.randn(3, 4), torch.randn(4, 2)
    torch.testing.assert_close(f3(x, w), x @ w * 3)


def test_a_stage_of_alike_layers_reuses_its_graph_segments_code_and_equals_eager() -> None:
    torch._dynamo.reset()
    cfg = REFERENCE_CONFIGS["small-dense"].replace(num_layers=3 * 4)
    options = {"segment_compiler": "eager", "graph_mode": "emulate", "max_capture_tokens": 16}
    before = counters.eager_code_reuses
    got, want, _ = run_middle_stage(make_stage(cfg, 1, 3), cfg, options, (1, 8, 9, 16, 23))
    # 4 layers: one graph segment between each two attentions, three alike
    assert counters.eager_code_reuses - before >= 2
    for n, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, f"call {n}")

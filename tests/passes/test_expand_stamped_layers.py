"""``expand_stamped_layers``: each stamped layer's one op becomes a copy of its exemplar's ops, reading
the layer's own weights (new graph inputs) and its own per-layer constants."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from fx_helpers import make_ctx
from torch import nn

import ppcompile
from ppcompile.analysis.copied_calls import innermost_module
from ppcompile.analysis.node_facts import BOUND_WEIGHT
from ppcompile.passes.context import PassContext, PassResult
from ppcompile.passes.expand_stamped_layers import expand_stamped_layers

H = 8


@torch.library.custom_op("ppcompile_test::tagged", mutates_args=())
def tagged(x: torch.Tensor, layer: int) -> torch.Tensor:
    """``x`` plus its layer's index: a custom op taking a per-layer constant (as attention, a layer id)."""
    return x + layer


@tagged.register_fake
def _(x: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(x)


class Layer(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.up = nn.Linear(H, H)
        self.register_buffer("shift", torch.full((H,), float(index)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.ppcompile_test.tagged(torch.relu(self.up(x)), self.index) + self.shift


class Stack(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Layer(i) for i in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _run_in_a_trace(m: nn.Module, x: torch.Tensor) -> tuple[torch.fx.GraphModule, PassResult, PassContext]:
    """Dynamo's graph of ``m(x)`` and the pass's result on it, run inside the trace (where the stamps'
    checks live), as the backend runs it."""
    torch._dynamo.reset()
    seen: list[Any] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        before = torch.fx.GraphModule(gm, gm.graph.__deepcopy__())
        ctx = make_ctx(gm, example_inputs)
        seen.append((before, expand_stamped_layers(gm, ctx), ctx))
        return gm.forward

    ppcompile.mark_token_dynamic(x)
    with torch.no_grad():
        torch.compile(m, backend=backend, fullgraph=True)(x)
    (result,) = seen
    return result  # type: ignore[no-any-return]


def _targets(gm: torch.fx.GraphModule, name: str) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and name in str(n.target)]


def test_stamped_layers_become_their_own_copies_of_the_exemplar() -> None:
    m = ppcompile.trace_layers_once(Stack(3), stamp=True)
    x = torch.randn(5, H)
    before, result, ctx = _run_in_a_trace(m, x)
    assert len(_targets(before, "stamped_layer")) == 2 and len(_targets(before, "tagged")) == 1
    out = result.graph_module
    assert result.modified and ctx.stamped_layers == 2
    for op in ("stamped_layer", "layer_input", "layer_output"):
        assert not _targets(out, op), op
    assert [n.args[1] for n in _targets(out, "tagged")] == [0, 1, 2]  # each layer's own constant
    bound = [n for n in out.graph.find_nodes(op="placeholder") if BOUND_WEIGHT.has(n)]
    assert [BOUND_WEIGHT.of(n) for n in bound] == [
        f"layers.{i}.{name}" for i in (1, 2) for name in ("up.weight", "up.bias", "shift")]
    own = [m.layers[i].up.weight for i in (1, 2)]
    assert [t for t in ctx.bound_inputs if t.dim() == 2] == own and all(
        a is b for a, b in zip([t for t in ctx.bound_inputs if t.dim() == 2], own))
    assert ctx.example_inputs[-len(ctx.bound_inputs):] == ctx.bound_inputs
    with torch.no_grad():
        (got,) = out(*ctx.example_inputs)
        torch.testing.assert_close(got, m(x))
    paths = {str(entry[0]) for n in _targets(out, "tagged") for entry in n.meta["nn_module_stack"].values()}
    assert {p for p in paths if p.endswith(("layers.1", "layers.2"))}  # each copy names its own layer


def test_a_graph_without_stamps_is_left_alone() -> None:
    before, result, _ = _run_in_a_trace(Stack(3), torch.randn(5, H))
    assert not result.modified and result.graph_module.code == before.code


def test_the_copied_ops_of_one_module_share_one_module_stack() -> None:
    """The copies live as long as the compiled stage: the ops one module ran share one stack in a
    copy, as in Dynamo's graph, rather than one each; each layer's copies keep stacks of their own."""
    m = ppcompile.trace_layers_once(Stack(3), stamp=True)
    _, result, _ = _run_in_a_trace(m, torch.randn(5, H))
    stacks: dict[str, set[int]] = {}
    for n in result.graph_module.graph.nodes:
        if n.op in ("call_function", "call_method") and (path := innermost_module(n)) is not None:
            stacks.setdefault(path, set()).add(id(n.meta["nn_module_stack"]))
    copied = {p: ids for p, ids in stacks.items() if p.endswith(("layers.1", "layers.2"))}
    assert len(copied) == 2 and all(len(ids) == 1 for ids in copied.values()), stacks
    assert len(set.union(*copied.values())) == 2

"""``inline_nested_regions``: calls of ``torch.compiler.nested_compile_region`` functions become plain ops."""

from __future__ import annotations

import operator
import re
import warnings
from typing import Any

import pytest
import torch
from fx_helpers import dynamo_graph, make_ctx
from torch import nn

import ppcompile
from ppcompile.passes.inline_nested_regions import inline_nested_regions

region = getattr(torch.compiler, "nested_compile_region", None)
pytestmark = pytest.mark.skipif(region is None, reason="this torch has no nested_compile_region")
H = 8


def _mlp(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer.down(torch.relu(layer.up(x))) + x


mlp_region = region(_mlp) if region is not None else _mlp


@region  # type: ignore[misc]
def _block(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A region calling a region, returning two fresh tensors."""
    y = mlp_region(layer, x)
    return y * 2, y.sum(dim=-1, keepdim=True)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(H, 2 * H)
        self.down = nn.Linear(2 * H, H)


class Stack(nn.Module):
    def __init__(self, n: int, nested: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Layer() for _ in range(n))
        self.nested = nested

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total = torch.zeros_like(x[:, :1])
        for layer in self.layers:
            if self.nested:
                x, s = _block(layer, x)
                total = total + s
            else:
                x = mlp_region(layer, x)
        return x, total


def _graph(m: nn.Module, x: torch.Tensor) -> tuple[torch.fx.GraphModule, list[Any]]:
    ppcompile.mark_token_dynamic(x)
    return dynamo_graph(m, x, dynamic=None)


def _hops(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if "invoke_subgraph" in str(n.target)]


@pytest.mark.parametrize("nested", [False, True])
def test_every_region_call_becomes_the_ops_of_its_subgraph(nested: bool) -> None:
    m = Stack(4, nested)
    x = torch.randn(5, H)
    gm, inputs = _graph(m, x)
    assert len(_hops(gm)) == 4  # one subgraph, called per layer: traced once
    want = gm(*inputs)
    result = inline_nested_regions(gm, make_ctx(gm, inputs))
    out = result.graph_module
    assert result.modified and not _hops(out)
    assert not any(isinstance(c, torch.fx.GraphModule) for c in out.children())  # subgraphs dropped
    linears = [n for n in out.graph.nodes if n.target is torch._C._nn.linear]
    assert len(linears) == 8  # each layer's own two
    weights = {n.args[1] for n in linears}
    assert len(weights) == 8  # ... reading its own weights
    for node in out.graph.nodes:  # the traced values come along: later passes read them
        if node.op == "call_function":
            assert "example_value" in node.meta or "val" in node.meta, node.format_node()
    for got, exp in zip(out(*inputs), want):
        torch.testing.assert_close(got, exp)
    with torch.no_grad():
        for got, exp in zip(out(*inputs), m(x)):
            torch.testing.assert_close(got, exp)


def test_a_graph_without_regions_is_left_alone() -> None:
    gm, inputs = dynamo_graph(lambda t: torch.relu(t) + 1, torch.randn(4, H))
    before = gm.code
    result = inline_nested_regions(gm, make_ctx(gm, inputs))
    assert not result.modified and result.graph_module.code == before


@pytest.mark.parametrize("model", ["small-dense", "small-moe", "hidden-only", "topk"])
def test_a_stage_with_regions_compiles_to_the_same_segments_and_numbers(model: str) -> None:
    """The reference model with ``compile_regions``: one traced copy of each layer half, and after the
    pass the same split, buckets and results as the flat trace."""
    from ppcompile.models import (
        REFERENCE_CONFIGS,
        make_batch,
        make_forward_context,
        make_stage,
        set_forward_context,
    )

    cfg = REFERENCE_CONFIGS[model].replace(num_layers=12, compile_regions=True)
    stage = make_stage(cfg, 1, 4)
    options = {"capture_sizes": [4, 8, 16], "graph_mode": "emulate"}
    compiled = torch.compile(stage, backend="pp_breakable", options=options)
    for i, n in enumerate((5, 16, 17, 1, 8)):
        _, pos, proxies = make_batch(cfg, [n], 1, 4, seed=n)
        if i == 0:
            ppcompile.mark_token_dynamic(pos, proxies)
        with torch.inference_mode(), set_forward_context(make_forward_context([n], cfg, range(3, 6))):
            got = compiled(None, pos, pp_proxy_tensors=proxies)
            want = stage(None, pos, pp_proxy_tensors=proxies)
        for key in want:
            torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0)
    rt = [r for r in ppcompile.stage_runtimes() if r.token_symbol is not None][-1]
    assert rt.layer_ids == (3, 4, 5) and rt.eager_reason is None
    attention = [s for s in rt.segments if s.reason is not None and "attention" in str(s.reason)]
    assert len(attention) == 3


def _attention_layer(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    q, k, v = (proj(x).view(-1, 2, H // 2).transpose(0, 1) for proj in (layer.q, layer.k, layer.v))
    a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return x + layer.o(a.transpose(0, 1).reshape(-1, H))


attention_region = region(_attention_layer) if region is not None else _attention_layer


class AttentionStack(nn.Module):
    """Whole layers as one region each, attention included: fine when nothing in it differs per layer."""

    def __init__(self, n: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.ModuleDict({p: nn.Linear(H, H) for p in "qkvo"}) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = attention_region(layer, x)
        return x


def test_a_region_holding_a_break_op_splits_there_once_inlined() -> None:
    m = AttentionStack(3)
    options = {"capture_sizes": [8, 16], "graph_mode": "emulate"}
    compiled = torch.compile(m, backend="pp_breakable", options=options)
    with ppcompile.counters.expect(replays=2, backend_compiles=1):
        for i, n in enumerate((10, 16)):
            x = torch.randn(n, H)
            if i == 0:
                ppcompile.mark_token_dynamic(x)
            with torch.no_grad():
                torch.testing.assert_close(compiled(x), m(x))
    rt = ppcompile.stage_runtimes()[-1]
    assert [s.is_graph for s in rt.segments] == [True, False] * 3 + [True]


class IdLayer(nn.Module):
    """A layer with a per-layer constant (so ``trace_layers_once`` makes its MLP, not the layer, a region)."""

    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.mlp = nn.Sequential(nn.Linear(H, 2 * H), nn.ReLU(), nn.Linear(2 * H, H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x) * (self.layer_id + 1)


class IdStack(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(IdLayer(i) for i in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_each_inlined_copy_is_stacked_under_its_own_call_only() -> None:
    """Every module on an inlined node's stack is its own call's: the layer the region was traced in (and
    its ancestors above the region) must not stay on the other calls' copies, or passes that name a
    region by its outermost module (declared token-local layers, library regions) mix layers up."""
    m = ppcompile.trace_layers_once(IdStack(3), stamp=False, min_region_modules=1)  # a 2-linear MLP region
    gm, inputs = _graph(m, torch.randn(5, H))
    assert len(_hops(gm)) == 3
    out = inline_nested_regions(gm, make_ctx(gm, inputs)).graph_module
    linears = [n for n in out.graph.nodes if n.target is torch._C._nn.linear]
    assert len(linears) == 6
    called: list[str] = []
    for node in linears:
        paths = [str(entry[0]) for entry in node.meta["nn_module_stack"].values()]
        layers = {m.group(1) for p in paths if (m := re.search(r"layers[.\[](\d+)", p))}
        assert len(layers) == 1, (node.name, paths)  # one layer index on the whole stack
        called += layers
    assert called == ["0", "0", "1", "1", "2", "2"]  # each copy under its own call's layer


def test_copies_of_a_call_traced_flat_go_and_the_graph_is_modified() -> None:
    """Under dynamic=True the layers trace flat, yet their region copies reach the graph."""
    from ppcompile.tracing.marker_ops import region_copy, region_write_back

    def f(t: torch.Tensor) -> torch.Tensor:
        c = region_copy(t)
        out = torch.relu(c) + 1
        region_write_back(t, c)
        return out

    gm, inputs = dynamo_graph(f, torch.randn(4, H))
    want = gm(*inputs)
    result = inline_nested_regions(gm, make_ctx(gm, inputs))
    assert result.modified
    code = result.graph_module.code
    assert "region_copy" not in code and "region_write_back" not in code
    torch.testing.assert_close(result.graph_module(*inputs), want)


def test_a_constant_a_region_reads_is_lifted_once_and_each_copy_has_its_own_meta() -> None:
    """A region subgraph that reads a module attribute (``get_attr``; Dynamo inlines those in the stages
    tried, so the graphs are built by hand): every inlined call reads the one lifted attribute through
    a node of its own, whose meta a later pass may change without changing the other copies'."""
    hop = torch.ops.higher_order.invoke_subgraph
    inner = torch.fx.Graph()
    x = inner.placeholder("x")
    scale = inner.get_attr("scale")
    scale.meta["note"] = "traced"
    inner.output((inner.call_function(torch.mul, (x, scale)),))
    holder = nn.Module()
    holder.register_buffer("scale", torch.full((H,), 3.0))
    root = nn.Module()
    root.repeated_subgraph0 = torch.fx.GraphModule(holder, inner)
    outer = torch.fx.Graph()
    value = outer.placeholder("a")
    ref = outer.get_attr("repeated_subgraph0")
    for _ in range(2):
        call = outer.call_function(hop, (ref, "subgraph_0", value))
        value = outer.call_function(operator.getitem, (call, 0))
    outer.output((value,))
    gm = torch.fx.GraphModule(root, outer)
    a = torch.randn(2, H)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FX warns of a get_attr of an attribute that is no buffer
        out = inline_nested_regions(gm, make_ctx(gm, [a])).graph_module
    reads = [n for n in out.graph.nodes if n.op == "get_attr"]
    assert len(reads) == 2 and len({str(n.target) for n in reads}) == 1  # one lifted attribute
    assert reads[0].meta is not reads[1].meta and reads[1].meta["note"] == "traced"
    assert not any(isinstance(child, torch.fx.GraphModule) for child in out.children())  # the subgraph went
    torch.testing.assert_close(out(a)[0], a * 9)

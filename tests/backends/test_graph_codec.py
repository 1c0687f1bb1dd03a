"""graph_codec: a Dynamo stage graph written to bytes and read back keeps what ppcompile's passes read,
and compiles to the same split."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import ppcompile
from ppcompile.backends.graph_codec import GraphCodecError, dumps_stage_graph, loads_stage_graph
from ppcompile.models import ModelConfig, make_batch, make_forward_context, make_stage, set_forward_context
from ppcompile.symbolic import example_value
from ppcompile.torch_internals import tracing_context

CFG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1,
                  head_dim=8, num_layers=4)
OPTIONS = {"graph_mode": "emulate", "capture_sizes": [4, 8]}


def _traced() -> tuple[torch.fx.GraphModule, bytes, list[Any], Any]:
    """The reference stage's Dynamo graph (rank 1 of 2, as traced: a copy from before the passes), its
    bytes written during the trace, its example inputs, and the runtime pp_breakable built from it."""
    seen: list[Any] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        as_traced = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        data = dumps_stage_graph(gm)
        runtime = ppcompile.pp_breakable(gm, example_inputs, OPTIONS)
        seen.extend([as_traced, data, list(example_inputs), runtime])
        return runtime

    stage = make_stage(CFG, 1, 2)
    _, pos, proxies = make_batch(CFG, [6], 1, 2)
    ppcompile.mark_token_dynamic(pos, proxies)
    with torch.inference_mode(), set_forward_context(make_forward_context([6], CFG, range(2, 4))):
        torch.compile(stage, backend=backend)(None, pos, pp_proxy_tensors=proxies)
    gm, data, inputs, runtime = seen
    return gm, data, inputs, runtime


def _value_summary(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return ("tensor", str(tuple(v.shape)), str(v.stride()), str(v.storage_offset()), v.dtype,
                v.device, isinstance(v, torch.nn.Parameter))
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("sym", str(v))
    if isinstance(v, (tuple, list)):
        return tuple(_value_summary(x) for x in v)
    return v


def test_read_back_keeps_every_node_and_the_metadata_the_passes_read() -> None:
    gm, data, _, _ = _traced()
    loaded, fake_mode = loads_stage_graph(data)
    pairs = list(zip(gm.graph.nodes, loaded.graph.nodes, strict=True))
    assert any("s" in str(_value_summary(example_value(a))) for a, _ in pairs)  # symbolic sizes kept
    for a, b in pairs:
        assert (a.op, a.name, str(a.target)) == (b.op, b.name, str(b.target))
        assert _value_summary(a.meta.get("example_value")) == _value_summary(b.meta.get("example_value"))
        assert a.meta.get("nn_module_stack") == b.meta.get("nn_module_stack")
        assert a.meta.get("stack_trace") == b.meta.get("stack_trace")
        if "grapharg" in a.meta:
            source = a.meta["grapharg"].source
            assert b.meta["grapharg"].source.name == source.name
    values = [v for _, b in pairs if isinstance(v := b.meta.get("example_value"), torch.Tensor)]
    assert values and all(v.fake_mode is fake_mode for v in values)


def test_the_read_back_graph_compiles_to_the_same_split() -> None:
    _, data, inputs, first = _traced()
    loaded, fake_mode = loads_stage_graph(data)
    with tracing_context(fake_mode):
        again = ppcompile.pp_breakable(loaded, inputs, OPTIONS)
    segments = [[line for line in rt.describe().splitlines() if "submod_" in line] for rt in (again, first)]
    assert segments[0] and segments[0] == segments[1]
    assert again.token_symbol == first.token_symbol
    assert again.plan.sizes == first.plan.sizes


def test_writing_needs_the_trace_and_plain_values() -> None:
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(GraphCodecError, match="no Dynamo trace"):
        dumps_stage_graph(gm)


def test_a_symbolic_size_value_is_written_and_read_back() -> None:
    """A node whose value is a ``torch.Size`` of symbolic sizes (a shape passed to an op, as vLLM's CPU
    linear passes its output's) is written as one and read back as one."""
    seen: list[Any] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        seen.append((gm, dumps_stage_graph(gm)))
        return gm

    x = torch.randn(5, 3)
    torch._dynamo.mark_dynamic(x, 0)
    torch.compile(lambda x: torch.ops.aten.new_zeros.default(x, x.size()), backend=backend)(x)
    ((gm, data),) = seen
    loaded, _ = loads_stage_graph(data)
    sizes = [(a.meta["example_value"], b.meta["example_value"])
             for a, b in zip(gm.graph.nodes, loaded.graph.nodes, strict=True)
             if isinstance(a.meta.get("example_value"), torch.Size)]
    assert sizes and all(type(b) is torch.Size and str(b) == str(a) for a, b in sizes)

"""Tests of ``engine_ops``: known engine ops need no declaration, their roles hold end to end.

The ops are registered here under the registered names of vLLM's ops, with the same schemas and the same
contracts (a cache write that declares no mutation, an attention op that fills its ``output`` and takes a
layer name), implemented in plain torch; tests/engines runs the real vLLM.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from stage_checks import assert_close

import ppcompile
from ppcompile.engine_ops import ENGINE_OPS, OpRole, layer_from_name, names_with_role
from ppcompile.records import BreakKind

LIB = "vllm"
CACHES: dict[str, torch.Tensor] = {}  # layer name -> [slots, 2, 8]: what a forward context would hold
SLOTS: list[torch.Tensor] = []  # the current forward's slot mapping, set by the test as an engine would


@torch.library.custom_op("_C::rms_norm", mutates_args=("result",))
def _rms_norm(result: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    result.copy_(input * torch.rsqrt(input.pow(2).mean(-1, keepdim=True) + epsilon) * weight)


@torch.library.custom_op("_C::rotary_embedding", mutates_args=("query", "key"))
def _rotary(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int,
            cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    for x in (query, key):
        a, b = x[..., : head_size // 2], x[..., head_size // 2:]
        x.copy_(torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1))


@torch.library.custom_op(f"{LIB}::unified_kv_cache_update", mutates_args=())
def _kv_update(key: torch.Tensor, value: torch.Tensor, layer_name: str) -> torch.Tensor:
    cache = CACHES[layer_name]
    slots = SLOTS[-1][: key.shape[0]]
    cache[slots, 0] = key
    cache[slots, 1] = value
    return torch.empty(0)


@_kv_update.register_fake
def _(key: torch.Tensor, value: torch.Tensor, layer_name: str) -> torch.Tensor:
    return key.new_empty(0)


@torch.library.custom_op(f"{LIB}::unified_attention_with_output", mutates_args=("output",))
def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor,
               layer_name: str) -> None:
    n = query.shape[0]
    cache = CACHES[layer_name][SLOTS[-1][:n]]  # reads back what the cache write stored
    scores = (query @ cache[:, 0].T) / 8 ** 0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    output.copy_(scores.softmax(-1) @ cache[:, 1])


class Layer(torch.nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.name = f"model.layers.{index}.self_attn.attn"
        self.norm = torch.nn.Parameter(torch.rand(8) + 0.5, requires_grad=False)
        self.qkv = torch.nn.Linear(8, 24)
        self.out = torch.nn.Linear(8, 8)
        self.cos_sin = torch.nn.Parameter(torch.randn(64, 8), requires_grad=False)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        x = torch.empty_like(h)
        torch.ops._C.rms_norm(x, h, self.norm, 1e-6)
        q, k, v = self.qkv(x).split(8, dim=-1)
        q, k = q.contiguous(), k.contiguous()
        torch.ops._C.rotary_embedding(positions, q, k, 8, self.cos_sin, True)
        torch.ops.vllm.unified_kv_cache_update(k, v, self.name)
        out = torch.empty_like(q)
        torch.ops.vllm.unified_attention_with_output(q, k, v, out, self.name)
        return h + self.out(out)


class Stage(torch.nn.Module):
    def __init__(self, first: int, count: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(first + i) for i in range(count))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states)
        return hidden_states


def _run(stage: Stage, fn: Any, n: int, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    positions, h = torch.arange(n), torch.randn(n, 8)
    for layer in stage.layers:
        CACHES[layer.name] = torch.zeros(80, 2, 8)
    SLOTS.append(torch.randperm(80)[:n] if n > 1 else torch.tensor([3]))
    ppcompile.mark_token_dynamic(positions, h)
    with torch.no_grad():
        out = fn(positions, h)
    return out, {name: cache.clone() for name, cache in CACHES.items()}


def test_a_vllm_style_stage_needs_no_declaration_and_breaks_once_per_layer(fresh_dynamo: None) -> None:
    torch.manual_seed(0)
    stage = Stage(first=2, count=3)
    compiled = torch.compile(stage, backend="pp_breakable",
                             options={"graph_mode": "emulate", "capture_sizes": [4, 8]})
    for n in (8, 1, 4, 5, 11):  # a bucket first, then 1, exactly a bucket, a bucket + 1, above the cap
        got, got_caches = _run(stage, compiled, n, seed=n)
        want, want_caches = _run(stage, stage, n, seed=n)
        assert_close(got, want, f"{n} tokens")
        assert_close(got_caches, want_caches, f"KV caches after {n} tokens")  # no padded row written
    (runtime,) = [r for r in ppcompile.stage_runtimes() if r.token_symbol is not None]
    assert runtime.eager_reason is None and runtime.captured_buckets, runtime.describe()
    breaks = [s for s in runtime.segments if not s.is_graph]
    assert len(breaks) == 3, runtime.describe()
    assert [s.layer_ids for s in breaks] == [(2,), (3,), (4,)]
    for s in breaks:
        assert s.reason is not None and s.reason.kind is BreakKind.STATE_WRITE
        assert "KV cache" in s.reason.detail
        assert "joined with the next break (attention: vllm.unified_attention_with_output" in s.reason.detail
    assert runtime.layer_ids == (2, 3, 4)
    assert ppcompile.counters.replays > 0


@pytest.mark.parametrize("op", ["vllm::unified_kv_cache_update", torch.ops.vllm.unified_kv_cache_update,
                                torch.ops.vllm.unified_kv_cache_update.default])
def test_a_state_writer_cannot_be_declared_token_local(op: Any) -> None:
    with pytest.raises(ValueError, match=r"unified_kv_cache_update cannot be token-local.*KV cache"):
        ppcompile.backend_with_options({"token_local_ops": [op]})


def test_a_state_writer_cannot_be_registered_token_local() -> None:
    with pytest.raises(ValueError, match="cannot be token-local"):
        ppcompile.register_token_local_op(torch.ops.vllm.unified_kv_cache_update.default)


def test_declaring_a_known_token_local_op_again_is_harmless(fresh_dynamo: None) -> None:
    torch.manual_seed(0)
    stage = Stage(first=0, count=1)
    compiled = torch.compile(stage, backend="pp_breakable", options={
        "graph_mode": "emulate", "capture_sizes": [4, 8], "token_local_ops": ["_C::rms_norm"],
        "split_ops": ["vllm::unified_attention_with_output"]})
    got, _ = _run(stage, compiled, 5, seed=1)
    want, _ = _run(stage, stage, 5, seed=1)
    assert_close(got, want, "5 tokens")
    (runtime,) = [r for r in ppcompile.stage_runtimes() if r.token_symbol is not None]
    assert len([s for s in runtime.segments if not s.is_graph]) == 1, runtime.describe()


@pytest.mark.parametrize(("value", "layer"), [
    (7, 7), ("model.layers.7.self_attn.attn", 7), ("language_model.model.layers.12.attn", 12),
    ("layers.0", 0), ("attn", None), ("model.layers.3.experts.1", None), (True, None), (None, None),
    ("model.layers.x7.attn", None),
])
def test_layer_from_name(value: Any, layer: int | None) -> None:
    assert layer_from_name(value) == layer


def test_every_entry_is_a_registered_name_with_a_role() -> None:
    for name, entry in ENGINE_OPS.items():
        ns, _, op = name.partition("::")
        assert ns and op and "::" not in op, name
        if entry.role is OpRole.STATE_WRITE:
            assert entry.writes and entry.layer_arg, name
    assert "vllm::unified_kv_cache_update" in names_with_role(OpRole.STATE_WRITE)
    assert "_C::onednn_mm" in names_with_role(OpRole.TOKEN_LOCAL)


class _LayerName:
    """What vLLM passes on torch >= 2.11: the layer name wrapped in an object, a graph input to Dynamo."""

    def __init__(self, value: str) -> None:
        self.value = value


def test_a_layer_name_passed_as_a_graph_input_gives_the_layer() -> None:
    from ppcompile.analysis.op_matching import attention_layer_id

    graph = torch.fx.Graph()
    q, name = graph.placeholder("q"), graph.placeholder("layer_name")
    out = graph.call_function(torch.ops.aten.empty_like.default, (q,))
    call = graph.call_function(torch.ops.vllm.unified_attention_with_output.default, (q, q, q, out, name))
    graph.output(out)
    assert attention_layer_id(call, {name: _LayerName("model.layers.5.self_attn.attn")}) == 5
    assert attention_layer_id(call) is None  # the input's value unknown: no layer
    const = graph.call_function(torch.ops.vllm.unified_attention_with_output.default,
                                (q, q, q, out, "model.layers.6.self_attn.attn"))
    assert attention_layer_id(const) == 6

"""Tests for the reference PP-stage models (``ppcompile.models``): splits, composition, the attention op,
Dynamo traceability and varlen causality."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import fx
from torch.nn.attention import SDPBackend, sdpa_kernel

from ppcompile.models import (
    REFERENCE_CONFIGS,
    ModelConfig,
    PPStage,
    get_forward_context,
    get_pp_indices,
    make_batch,
    make_forward_context,
    make_stage,
    set_forward_context,
)
from ppcompile.models.layers import DecoderLayer, PPMissingLayer, RMSNorm
from ppcompile.proxy import PPProxyTensors

DENSE = REFERENCE_CONFIGS["small-dense"]
MOE = REFERENCE_CONFIGS["small-moe"]
HIDDEN_ONLY = REFERENCE_CONFIGS["hidden-only"]
TOPK = REFERENCE_CONFIGS["topk"]
ATOL = 1e-5


def _ctx(cfg: ModelConfig, seq_lens: Sequence[int]):  # type: ignore[no-untyped-def]
    return set_forward_context(make_forward_context(seq_lens, cfg, range(cfg.num_layers)))


def _run_chain(cfg: ModelConfig, pp_size: int, seq_lens: Sequence[int], seed: int = 0) -> torch.Tensor:
    """Run stages 0..pp_size-1 in sequence, feeding each one's proxies into the next; return logits."""
    input_ids, positions, _ = make_batch(cfg, seq_lens, 0, pp_size, seed=seed)
    out: torch.Tensor | PPProxyTensors | None = None
    with torch.no_grad(), _ctx(cfg, seq_lens):
        for rank in range(pp_size):
            stage = make_stage(cfg, rank, pp_size)
            proxies = out if isinstance(out, PPProxyTensors) else None
            out = stage(input_ids if rank == 0 else None, positions, proxies)
            assert isinstance(out, torch.Tensor) == stage.is_last
    assert isinstance(out, torch.Tensor)
    return out


# ----------------------------------------------------------------------------------------- config/splits
def test_config_validation() -> None:
    for bad in (
        {"num_heads": 3},  # not a multiple of num_kv_heads=2
        {"head_dim": 15},
        {"num_layers": 0},
        {"num_experts": 2, "experts_top_k": 3},
        {"topk_proxy": 65},
        {"dtype": torch.int32},
        {"in_place_norm": True, "hidden_only": True},
        {"in_place_norm": True, "compile_regions": True},
    ):
        with pytest.raises(ValueError, match="ModelConfig"):
            ModelConfig(**bad)
    assert {"tiny", "small-dense", "small-moe", "hidden-only", "topk"} <= set(REFERENCE_CONFIGS)


@pytest.mark.parametrize("num_layers", [5, 8, 10, 32])
def test_get_pp_indices_covers_all_layers(num_layers: int) -> None:
    for pp_size in range(1, 6):
        ranges = [get_pp_indices(num_layers, r, pp_size) for r in range(pp_size)]
        covered = [i for start, end in ranges for i in range(start, end)]
        assert covered == list(range(num_layers))
        sizes = [end - start for start, end in ranges]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes)  # remainder to the last stages
    assert get_pp_indices(10, 0, 4) == (0, 2) and get_pp_indices(10, 3, 4) == (7, 10)


@pytest.mark.parametrize("args", [(8, 0, 0), (8, -1, 2), (8, 2, 2), (3, 0, 4), (0, 0, 1)])
def test_get_pp_indices_rejects_bad_args(args: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError, match="get_pp_indices"):
        get_pp_indices(*args)


def test_layers_keep_global_numbering() -> None:
    for rank in range(3):
        stage = make_stage(DENSE, rank, 3)
        assert len(stage.layers) == DENSE.num_layers
        assert (stage.is_first, stage.is_last) == (rank == 0, rank == 2)
        assert (stage.embed_tokens is not None) == stage.is_first
        assert (stage.lm_head is not None) == stage.is_last
        for i, layer in enumerate(stage.layers):
            if stage.start_layer <= i < stage.end_layer:
                assert isinstance(layer, DecoderLayer) and layer.self_attn.layer_id == i
            else:
                assert isinstance(layer, PPMissingLayer)
                with pytest.raises(RuntimeError, match="another pipeline stage"):
                    layer()
        assert not any(p.requires_grad for p in stage.parameters()) and not stage.training


def test_weights_depend_only_on_global_layer_id() -> None:
    a, b = make_stage(DENSE, 1, 2), make_stage(DENSE, 2, 4)  # both own layer 4
    assert a.start_layer == b.start_layer == 4
    for (name, pa), pb in zip(a.layers[4].named_parameters(), b.layers[4].parameters(), strict=True):
        assert torch.equal(pa, pb), name


# ------------------------------------------------------------------------------------------- composition
@pytest.mark.parametrize("name", ["small-dense", "small-moe", "hidden-only"])
def test_pp_chain_equals_full_model(name: str) -> None:
    cfg = REFERENCE_CONFIGS[name]
    full = _run_chain(cfg, 1, [7, 4])
    assert torch.isfinite(full).all()
    for pp_size in (2, 4):
        torch.testing.assert_close(_run_chain(cfg, pp_size, [7, 4]), full, atol=ATOL, rtol=0)


def _topk_reference(cfg: ModelConfig, pp_size: int, seq_lens: Sequence[int]) -> torch.Tensor:
    """The full model's layers run one by one, with the topk proxy recomputed and injected by hand at
    each stage boundary of the ``pp_size`` split (using that stage's ``topk_embed``)."""
    full = make_stage(cfg, 0, 1)
    stages = [make_stage(cfg, r, pp_size) for r in range(pp_size)]
    boundaries = {s.start_layer: s for s in stages[1:]}
    input_ids, positions, _ = make_batch(cfg, seq_lens, 0, pp_size)
    assert full.embed_tokens is not None and full.norm is not None and full.lm_head is not None
    with torch.no_grad(), _ctx(cfg, seq_lens):
        hidden, residual = full.embed_tokens(input_ids), None
        for i in range(cfg.num_layers):
            if i in boundaries:
                topk = torch.topk(hidden, cfg.topk_proxy, dim=-1).indices.to(torch.int32)
                embed = boundaries[i].topk_embed
                assert embed is not None
                hidden = hidden + embed(topk).sum(1)
            hidden, residual = full.layers[i](positions, hidden, residual)
        return full.lm_head(full.norm(hidden, residual)[0])


def test_topk_chain_equals_reference_with_injections() -> None:
    """With ``topk_proxy > 0`` each non-first stage adds ``topk_embed(topk_indices)``, so different splits
    are different models (the full model has no boundary at all). Sound comparisons: (1) every chain equals
    the full model's layers with the injection recomputed by hand at that split's boundaries; (2) splits
    sharing a boundary share its ``topk_embed`` (seeded by start layer); (3) the topk proxy matters."""
    for pp_size in (2, 4):
        torch.testing.assert_close(_run_chain(TOPK, pp_size, [6, 5]), _topk_reference(TOPK, pp_size, [6, 5]),
                                   atol=ATOL, rtol=0)
    e2, e4 = make_stage(TOPK, 1, 2).topk_embed, make_stage(TOPK, 2, 4).topk_embed
    assert e2 is not None and e4 is not None and torch.equal(e2.weight, e4.weight)
    assert not torch.allclose(_run_chain(TOPK, 2, [6, 5]), _run_chain(TOPK, 1, [6, 5]), atol=1e-3)


def test_stage_proxy_keys_and_dtypes() -> None:
    for cfg, keys in ((DENSE, {"hidden_states", "residual"}), (HIDDEN_ONLY, {"hidden_states"}),
                      (TOPK, {"hidden_states", "residual", "topk_indices"})):
        for rank in (0, 1):
            ids, pos, proxies = make_batch(cfg, [3, 2], rank, 3)
            assert (ids is None) == (rank > 0) and (proxies is None) == (rank == 0)
            assert pos.tolist() == [0, 1, 2, 0, 1]
            with torch.no_grad(), _ctx(cfg, [3, 2]):
                out = make_stage(cfg, rank, 3)(ids, pos, proxies)
            assert isinstance(out, PPProxyTensors) and set(out) == keys
            assert proxies is None or set(proxies) == keys
            assert out["hidden_states"].shape == (5, cfg.hidden_size)
            if cfg.topk_proxy:
                assert out["topk_indices"].dtype == torch.int32
                assert out["topk_indices"].shape == (5, cfg.topk_proxy)
    with pytest.raises(ValueError, match="'residual'"), _ctx(DENSE, [2]):
        make_stage(DENSE, 1, 2)(None, torch.arange(2), PPProxyTensors({"hidden_states": torch.zeros(2, 64)}))


# ---------------------------------------------------------------------------------------- attention op
def test_attention_op_errors() -> None:
    cfg = DENSE
    q = torch.randn(4, cfg.num_heads, cfg.head_dim)
    kv = torch.randn(4, cfg.num_kv_heads, cfg.head_dim)
    with pytest.raises(RuntimeError, match="without a forward context"):
        get_forward_context()
    with pytest.raises(RuntimeError, match="without a forward context"):
        torch.ops.ppcompile.attention(q, kv, kv, 0)
    with set_forward_context(make_forward_context([2, 3], cfg, [0, 1])), pytest.raises(
        RuntimeError, match="got 4 rows but the batch has 5 tokens"
    ):
        torch.ops.ppcompile.attention(q, kv, kv, 0)
    with set_forward_context(make_forward_context([4], cfg, [0, 1])), pytest.raises(
        RuntimeError, match=r"global layer id 7.*\[0, 1\]"
    ):
        torch.ops.ppcompile.attention(q, kv, kv, 7)


def test_attention_op_writes_kv_cache() -> None:
    cfg = DENSE
    q = torch.randn(5, cfg.num_heads, cfg.head_dim)
    k, v = torch.randn(2, 5, cfg.num_kv_heads, cfg.head_dim)
    ctx = make_forward_context([2, 3], cfg, [3], num_slots=8)
    assert ctx.cu_seqlens.tolist() == [0, 2, 5] and ctx.cu_seqlens.dtype == torch.int32
    with set_forward_context(ctx):
        out = torch.ops.ppcompile.attention(q, k, v, 3)
    assert out.shape == q.shape
    torch.testing.assert_close(ctx.kv_caches[3][:5, 0], k)
    torch.testing.assert_close(ctx.kv_caches[3][:5, 1], v)
    assert not ctx.kv_caches[3][5:].any()
    # the first token of each sequence attends only to itself: output = its (GQA-repeated) value
    torch.testing.assert_close(out[2], v[2].repeat_interleave(cfg.num_heads // cfg.num_kv_heads, 0))


def test_attention_runs_on_a_fused_sdpa_kernel() -> None:
    """Restricted to the flash kernel (CPU has one too), the op still runs: its SDPA inputs have the 4-D shape
    every fused kernel needs. 3-D inputs would fall back to the math kernel (n x n scores) on a GPU."""
    cfg = DENSE
    q = torch.randn(5, cfg.num_heads, cfg.head_dim)
    k, v = torch.randn(2, 5, cfg.num_kv_heads, cfg.head_dim)
    with set_forward_context(make_forward_context([2, 3], cfg, [3], num_slots=8)):
        want = torch.ops.ppcompile.attention(q, k, v, 3)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            got = torch.ops.ppcompile.attention(q, k, v, 3)
    torch.testing.assert_close(got, want)


def test_attention_with_output_writes_what_attention_returns() -> None:
    cfg = DENSE
    q = torch.randn(5, cfg.num_heads, cfg.head_dim)
    k, v = torch.randn(2, 5, cfg.num_kv_heads, cfg.head_dim)
    out = torch.full_like(q, float("nan"))
    with set_forward_context(make_forward_context([2, 3], cfg, [3], num_slots=8)):
        want = torch.ops.ppcompile.attention(q, k, v, 3)
        assert torch.ops.ppcompile.attention_with_output(q, k, v, out, 3) is None
        with pytest.raises(RuntimeError, match=r"out has shape \[4, 4, 16\]"):
            torch.ops.ppcompile.attention_with_output(q, k, v, out[:4], 3)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize("option", ["attention_with_output", "in_place_norm"])
def test_a_stage_with_an_in_place_variant_equals_the_functional_one(option: str) -> None:
    """The out-variant attention and the in-place norm compute exactly what the functional ops do."""
    cfg = DENSE.replace(num_layers=4)
    seq_lens = [3, 6]
    functional = _run_chain(cfg, 2, seq_lens)
    torch.testing.assert_close(_run_chain(cfg.replace(**{option: True}), 2, seq_lens), functional,
                               rtol=0, atol=0)


def test_fused_add_rms_norm_writes_both_tensors() -> None:
    x, residual = torch.randn(2, 5, 8).unbind(0)
    weight = torch.rand(8)
    want_residual = x + residual
    want = RMSNorm(8, 1e-6)(x, residual)[0] * weight
    torch.ops.ppcompile.fused_add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(residual, want_residual, rtol=0, atol=0)
    torch.testing.assert_close(x, want)


# ------------------------------------------------------------------------------------------------ dynamo
_TRACE_CFGS = {
    "dense": DENSE.replace(num_layers=4),
    "moe": MOE.replace(num_layers=4),
    "hidden-only": HIDDEN_ONLY.replace(num_layers=4),
    "topk": TOPK.replace(num_layers=4),
}
# pp_size=3 over 4 layers gives a first (1 layer), a middle (1 layer) and a last (2 layers) stage
_STAGE_KINDS = {"full": (0, 1), "first": (0, 3), "middle": (1, 3), "last": (2, 3)}


def _attention_calls(gm: fx.GraphModule) -> list[fx.Node]:
    targets = (torch.ops.ppcompile.attention, torch.ops.ppcompile.attention.default)
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


@pytest.mark.parametrize("kind", list(_STAGE_KINDS))
@pytest.mark.parametrize("cfg_name", list(_TRACE_CFGS))
def test_dynamo_traces_stage_fullgraph(cfg_name: str, kind: str) -> None:
    cfg = _TRACE_CFGS[cfg_name]
    rank, pp_size = _STAGE_KINDS[kind]
    stage: PPStage = make_stage(cfg, rank, pp_size)
    graphs: list[fx.GraphModule] = []

    def inspect_backend(gm: fx.GraphModule, example_inputs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(stage, backend=inspect_backend, fullgraph=True, dynamic=True)
    for num_tokens, seq_lens in ((5, [5]), (13, [6, 7])):
        ids, pos, proxies = make_batch(cfg, seq_lens, rank, pp_size, seed=num_tokens)
        with torch.no_grad(), _ctx(cfg, seq_lens):
            ref = stage(ids, pos, proxies)
            got = compiled(ids, pos, proxies)
        if isinstance(ref, PPProxyTensors):
            assert isinstance(got, PPProxyTensors) and set(got) == set(ref)
            for key in ref:
                torch.testing.assert_close(got[key], ref[key], atol=ATOL, rtol=0)
        else:
            assert isinstance(got, torch.Tensor) and got.shape == (num_tokens, cfg.vocab_size)
            torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    assert len(graphs) == 1, "dynamic=True should give one graph for T=5 and T=13"
    calls = _attention_calls(graphs[0])
    assert [n.args[3] for n in calls] == list(range(stage.start_layer, stage.end_layer))
    assert all(type(n.args[3]) is int for n in calls)


def test_dynamo_eager_backend_no_graph_break() -> None:
    cfg = _TRACE_CFGS["moe"]
    stage = make_stage(cfg, 1, 3)
    ids, pos, proxies = make_batch(cfg, [4, 9], 1, 3)
    torch._dynamo.reset()
    with torch.no_grad(), _ctx(cfg, [4, 9]):  # explain runs the graph, so it needs a context too
        explanation = torch._dynamo.explain(stage)(ids, pos, proxies)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    torch._dynamo.reset()
    compiled = torch.compile(stage, backend="eager", fullgraph=True, dynamic=True)
    with torch.no_grad(), _ctx(cfg, [4, 9]):
        got, ref = compiled(ids, pos, proxies), stage(ids, pos, proxies)
    assert isinstance(got, PPProxyTensors) and isinstance(ref, PPProxyTensors)
    torch.testing.assert_close(got["hidden_states"], ref["hidden_states"], atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------------------------ varlen
@pytest.mark.parametrize("name", ["small-dense", "small-moe"])
def test_varlen_batch_equals_sequences_alone(name: str) -> None:
    cfg = REFERENCE_CONFIGS[name]
    seq_lens = [5, 1, 8]
    stage = make_stage(cfg, 0, 1)
    ids, pos, _ = make_batch(cfg, seq_lens, 0, 1, seed=3)
    assert ids is not None
    with torch.no_grad(), _ctx(cfg, seq_lens):
        batched = stage(ids, pos)
    start = 0
    for n in seq_lens:
        with torch.no_grad(), _ctx(cfg, [n]):
            alone = stage(ids[start : start + n], pos[start : start + n])
        torch.testing.assert_close(batched[start : start + n], alone, atol=ATOL, rtol=0)
        start += n
    # causality: changing the last token of a sequence changes nothing before it
    ids2 = ids.clone()
    ids2[4] = (ids2[4] + 1) % cfg.vocab_size
    with torch.no_grad(), _ctx(cfg, seq_lens):
        changed = stage(ids2, pos)
    torch.testing.assert_close(changed[:4], batched[:4], atol=0, rtol=0)
    torch.testing.assert_close(changed[5:], batched[5:], atol=0, rtol=0)
    assert not torch.equal(changed[4], batched[4])

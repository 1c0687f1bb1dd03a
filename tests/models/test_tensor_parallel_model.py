"""The reference decoder, tensor-parallel over 2 gloo ranks: one break per layer, equal to the full model.

Each distributed test spawns two ranks (``spawn_ranks``, bounded by a timeout) that build their shards of
one stage with ``make_stage(..., tp=TensorParallel.of(group))`` and run it eagerly and compiled with
``pp_breakable``; the parent compares every answer with the single-process full model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ppcompile
from ppcompile.models import (
    REFERENCE_CONFIGS,
    ModelConfig,
    TensorParallel,
    get_pp_indices,
    make_batch,
    make_forward_context,
    make_stage,
    set_forward_context,
)
from ppcompile.models.tensor_parallel import shard_state_dict
from ppcompile.pipeline import spawn_ranks

TINY = REFERENCE_CONFIGS["tiny"]  # 4 layers, 4 heads over 2 KV heads, vocab 256
CONFIGS = {
    "dense": TINY,
    "moe": REFERENCE_CONFIGS["small-moe"].replace(num_layers=4),
    "regions": TINY.replace(compile_regions=True),  # nested compile regions with all-reduces inside
    "hidden-only": REFERENCE_CONFIGS["hidden-only"].replace(num_layers=4),
}
SIZES = [8, 16]
COUNTS = (1, 8, 9, 16, 17)  # 1, a bucket, a bucket + 1, the cap, above the cap
needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def _batch(cfg: ModelConfig, n: int, pp_rank: int, pp_size: int) -> tuple[Any, ...]:
    return make_batch(cfg, [n], pp_rank, pp_size, seed=n)


def _call(module: Any, cfg: ModelConfig, n: int, pp_rank: int, pp_size: int, tp_size: int) -> Any:
    """``module`` on the batch of ``n`` tokens, in a fresh forward context for its layers."""
    ids, pos, proxies = _batch(cfg, n, pp_rank, pp_size)
    layers = _stage_layers(cfg, pp_rank, pp_size)
    with set_forward_context(make_forward_context([n], cfg, layers, tp_size=tp_size)):
        out = module(ids, pos, pp_proxy_tensors=proxies)
    return dict(out) if isinstance(out, Mapping) else out


def _stage_layers(cfg: ModelConfig, pp_rank: int, pp_size: int) -> range:
    return range(*get_pp_indices(cfg.num_layers, pp_rank, pp_size))


def _cloned(out: Any) -> Any:
    return {k: v.clone() for k, v in out.items()} if isinstance(out, dict) else out.clone()


def _full(cfg: ModelConfig, pp_rank: int, pp_size: int) -> dict[int, Any]:
    stage = make_stage(cfg, pp_rank, pp_size)
    with torch.inference_mode():
        return {n: _cloned(_call(stage, cfg, n, pp_rank, pp_size, 1)) for n in COUNTS}


def _worker(rank: int, world: int, cfg: ModelConfig, pp_rank: int, pp_size: int,
            modes: tuple[str, ...], compiler: str) -> dict[str, Any]:
    """This rank's shards run eagerly, then compiled in each of ``modes``."""
    tp = TensorParallel.of(dist.new_group(list(range(world))))
    stage = make_stage(cfg, pp_rank, pp_size, tp=tp)
    results: dict[str, Any] = {}
    with torch.inference_mode():
        results["uncompiled"] = {"outs": {n: _cloned(_call(stage, cfg, n, pp_rank, pp_size, world))
                                          for n in COUNTS}}
        for mode in modes:
            torch._dynamo.reset()
            compiled = torch.compile(stage, backend="pp_breakable", options={
                "graph_mode": mode, "capture_sizes": SIZES, "segment_compiler": compiler})
            outs, paths = {}, []
            for i, n in enumerate((9, *COUNTS)):  # 9 first: the symbolic graph
                ids, pos, proxies = _batch(cfg, n, pp_rank, pp_size)
                if i == 0:
                    ppcompile.mark_token_dynamic(ids, pos, proxies)
                replays = ppcompile.counters.replays
                outs[n] = _cloned(_call(compiled, cfg, n, pp_rank, pp_size, world))
                paths.append("graph" if ppcompile.counters.replays > replays else "eager")
            (runtime,) = [rt for rt in ppcompile.runtimes_of(compiled) if rt.token_symbol is not None]
            results[mode] = {
                "outs": outs,
                "paths": paths,
                "breaks": [s.kind for s in runtime.segments].count("break"),
                "collectives": len(runtime.compiled.collectives),
                "group": runtime.agreement.size,
            }
    return results


def _check(got: Any, want: Any, where: str) -> None:
    if isinstance(want, dict):
        assert set(got) == set(want), where
        for key in want:
            _check(got[key], want[key], f"{where} {key}")
        return
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=lambda m: f"{where}: {m}")


def _run_and_check(cfg: ModelConfig, pp_rank: int, pp_size: int, modes: tuple[str, ...],
                   compiler: str = "eager") -> list[dict[str, Any]]:
    results = spawn_ranks(_worker, 2, args=(cfg, pp_rank, pp_size, modes, compiler), threads=1,
                          timeout_s=300)
    want = _full(cfg, pp_rank, pp_size)
    layers = len(_stage_layers(cfg, pp_rank, pp_size))
    for rank, by_mode in enumerate(results):
        for mode, got in by_mode.items():
            for n in COUNTS:
                _check(got["outs"][n], want[n], f"rank {rank} {mode} n={n}")
            if mode != "uncompiled":
                assert got["breaks"] == layers, (mode, got)  # attention only: the all-reduces stay graphed
                assert got["collectives"] >= 2 * layers and got["group"] == 2, (mode, got)
    return results


@needs_gloo
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tp2_stage_has_one_break_per_layer_and_equals_the_full_model(name: str) -> None:
    results = _run_and_check(CONFIGS[name], 0, 1, ("emulate", "eager", "none", "auto"))
    for by_mode in results:
        # after the first call (9 tokens: it captures) 1 (its padding guard), 8, 9, 16, 17 (above the cap)
        assert by_mode["emulate"]["paths"][1:] == ["eager", "graph", "graph", "graph", "eager"]
        assert by_mode["none"]["paths"] == ["eager"] * 6


@needs_gloo
@pytest.mark.parametrize(("pp_rank", "pp_size"), [(0, 2), (1, 2)])
def test_tp2_first_and_last_pp_stages_equal_the_full_model(pp_rank: int, pp_size: int) -> None:
    """A first stage (vocab-parallel embedding, proxies out) and a last one (proxies in, gathered logits)."""
    _run_and_check(TINY, pp_rank, pp_size, ("emulate",))


@needs_gloo
@pytest.mark.slow
def test_tp2_stage_with_inductor_segments_equals_the_full_model() -> None:
    _run_and_check(TINY, 0, 1, ("emulate",), compiler="inductor")


def test_shards_of_every_rank_put_back_together_are_the_full_weights() -> None:
    full = make_stage(TINY, 0, 1).state_dict()
    shards = [shard_state_dict(full, TINY, TensorParallel(r, 2, group=object())) for r in range(2)]
    q, kv = TINY.num_heads * TINY.head_dim, TINY.num_kv_heads * TINY.head_dim
    for name, weight in full.items():
        a, b = shards[0][name], shards[1][name]
        if "qkv_proj" in name:  # [q | k | v], each split by heads: rank 0's rows, then rank 1's
            cuts = [q // 2, kv // 2, kv // 2]
            rebuilt = torch.cat([p for qa, qb in zip(a.split(cuts), b.split(cuts)) for p in (qa, qb)])
            torch.testing.assert_close(rebuilt, weight, rtol=0, atol=0)
        elif "gate_up_proj" in name:
            half = a.shape[0] // 2
            rebuilt = torch.cat([a[:half], b[:half], a[half:], b[half:]])
            torch.testing.assert_close(rebuilt, weight, rtol=0, atol=0)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            torch.testing.assert_close(torch.cat([a, b], dim=1), weight, rtol=0, atol=0)
        elif name.startswith(("embed_tokens", "lm_head")):
            torch.testing.assert_close(torch.cat([a, b]), weight, rtol=0, atol=0)
        else:  # norms: replicated
            torch.testing.assert_close(a, weight, rtol=0, atol=0)
            torch.testing.assert_close(b, weight, rtol=0, atol=0)


def test_sizes_that_do_not_divide_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"do not divide by 4: \{'num_kv_heads': 2\}"):
        TensorParallel(0, 4, group=object()).check(TINY)  # 2 KV heads over 4 ranks
    with pytest.raises(ValueError, match="rank must be in"):
        TensorParallel(2, 2, group=object())
    with pytest.raises(ValueError, match="needs its process group"):
        TensorParallel(0, 2)

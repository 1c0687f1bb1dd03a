"""The capturable ``ppcompile::paged_attention`` op (``models.paged_attention``): against a naive
per-request reference, its KV writes, what padded rows and requests do, its capture under the strict CUDA
double, and the reference stages built on it under ``pp_breakable``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from cuda_double import StrictCuda

import ppcompile
from ppcompile.capturable import Rows, capturable_break
from ppcompile.models import (
    ModelConfig,
    PagedMetadata,
    make_paged_batch,
    make_paged_metadata,
    make_stage,
    paged_positions,
)
from ppcompile.proxy import PPProxyTensors
from ppcompile.records import BreakKind

BS, M, BLOCKS, D = 4, 6, 32, 8
ATOL = 1e-5


def _meta(new: Sequence[int], prefix: Sequence[int] | None = None, seed: int | None = 3) -> PagedMetadata:
    return make_paged_metadata(new, prefix, block_size=BS, blocks_per_request=M, num_blocks=BLOCKS,
                               shuffle_seed=seed)


def _qkv(t: int, hq: int, hkv: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(t, h, D, generator=gen) for h in (hq, hkv, hkv))  # type: ignore[return-value]


def _cache(hkv: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(BLOCKS * BS, 2, hkv, D, generator=torch.Generator().manual_seed(seed))


def _op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, m: PagedMetadata,
        layer_id: int = 0) -> torch.Tensor:
    return torch.ops.ppcompile.paged_attention(q, k, v, cache, m.query_start_loc, m.seq_lens, m.block_table,
                                               m.slot_mapping, layer_id, BS)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, new: Sequence[int],
               prefix: Sequence[int], table: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention per request in float64: the prefix KV from ``cache`` (before the op writes
    it), the new KV from ``k``/``v``."""
    out = torch.zeros_like(q)
    groups = q.shape[1] // k.shape[1]
    start = 0
    for r, (n, p) in enumerate(zip(new, prefix)):
        slots = [int(table[r, j // BS]) * BS + j % BS for j in range(p)]
        keys = torch.cat([cache[slots, 0], k[start:start + n]]).double().repeat_interleave(groups, dim=1)
        values = torch.cat([cache[slots, 1], v[start:start + n]]).double().repeat_interleave(groups, dim=1)
        for i in range(n):
            qi = q[start + i].double()  # [Hq, D]
            scores = torch.einsum("hd,shd->hs", qi, keys[: p + i + 1]) / math.sqrt(D)
            out[start + i] = torch.einsum("hs,shd->hd", scores.softmax(-1), values[: p + i + 1]).float()
        start += n
    return out


def _pad(m: PagedMetadata, tokens: int, requests: int) -> PagedMetadata:
    """``m`` padded to ``tokens`` rows and ``requests`` requests as the capturable contract says."""
    t, r = m.slot_mapping.shape[0], m.seq_lens.shape[0]
    qsl = torch.cat([m.query_start_loc, m.query_start_loc[-1:].expand(requests - r)])
    seq = torch.cat([m.seq_lens, m.seq_lens.new_zeros(requests - r)])
    table = torch.cat([m.block_table, m.block_table.new_zeros(requests - r, m.block_table.shape[1])])
    slots = torch.cat([m.slot_mapping, m.slot_mapping.new_full((tokens - t,), -1)])
    return PagedMetadata(qsl, seq, table, slots)


# ----------------------------------------------------------------------------------------- the op
@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (2, 2)])
@pytest.mark.parametrize("lens", [([5], [0]), ([3, 1, 6], [0, 0, 0]), ([3, 1, 6], [5, 0, 9]),
                                  ([2, 4], [17, 3])])
def test_op_matches_a_naive_reference(heads: tuple[int, int], lens: tuple[list[int], list[int]]) -> None:
    new, prefix = lens
    m = _meta(new, prefix)
    q, k, v = _qkv(sum(new), *heads)
    cache = _cache(heads[1])
    want = _reference(q, k, v, cache, new, prefix, m.block_table)
    torch.testing.assert_close(_op(q, k, v, cache, m), want, atol=ATOL, rtol=0)


def test_op_writes_the_live_slots_and_nothing_else() -> None:
    new = [3, 5, 2]
    m = _meta(new, [1, 0, 6])
    m.slot_mapping[0] = -1  # a live row without a slot (the first, whose slot the write falls back on)
    m.slot_mapping[6] = -1
    q, k, v = _qkv(sum(new), 4, 2)
    before = _cache(2)
    cache = before.clone()
    _op(q, k, v, cache, m)
    live = m.slot_mapping >= 0
    slots = m.slot_mapping[live]
    torch.testing.assert_close(cache[slots], torch.stack([k, v], 1)[live], atol=0, rtol=0)
    untouched = torch.ones(cache.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(cache[untouched], before[untouched])


def test_padded_rows_and_requests_change_nothing() -> None:
    """A call padded to 16 rows (slot -1, beyond ``query_start_loc[-1]``) and 5 requests (zero-length)
    writes the unpadded call's cache and outputs its live rows; padded rows output exactly 0."""
    new, prefix = [3, 1, 5], [2, 7, 0]
    m = _meta(new, prefix)
    q, k, v = _qkv(sum(new), 4, 2)
    cache = _cache(2)
    padded_cache = cache.clone()
    want = _op(q, k, v, cache, m)

    pq, pk, pv = (torch.cat([x, torch.full((16 - x.shape[0], *x.shape[1:]), 1e4)]) for x in (q, k, v))
    got = _op(pq, pk, pv, padded_cache, _pad(m, 16, 5))
    torch.testing.assert_close(got[: sum(new)], want, atol=ATOL, rtol=0)
    assert torch.equal(got[sum(new):], torch.zeros_like(got[sum(new):]))
    assert torch.equal(padded_cache, cache)


def test_an_all_padding_call_outputs_zeros_and_writes_nothing() -> None:
    m = _pad(_meta([1]), 8, 3)
    m.query_start_loc.zero_()  # no live request, no live row
    m.seq_lens.zero_()
    m.slot_mapping.fill_(-1)
    q, k, v = _qkv(8, 4, 2)
    cache = _cache(2)
    before = cache.clone()
    assert torch.equal(_op(q, k, v, cache, m), torch.zeros_like(q))
    assert torch.equal(cache, before)


def test_op_captures_under_the_strict_cuda_double(strict_cuda: StrictCuda) -> None:
    """One capture at 16 rows and 4 requests (no host read, no data-dependent shape), replayed with the
    padded metadata of two other batches, equals eager calls."""
    tokens, requests = 16, 4
    q, k, v = _qkv(tokens, 4, 2)
    cache = _cache(2)
    meta = _pad(_meta([2, 3], [1, 0]), tokens, requests)
    g = strict_cuda.CUDAGraph()
    with strict_cuda.graph(g):
        out = _op(q, k, v, cache, meta)
    for i, (new, prefix) in enumerate([([4, 1, 6], [3, 9, 0]), ([16], [5]), ([1, 1, 1, 1], [0, 2, 4, 6])]):
        live = _pad(_meta(new, prefix, seed=i), tokens, requests)
        fresh_q, fresh_k, fresh_v = _qkv(tokens, 4, 2, seed=10 + i)
        start = _cache(2, seed=20 + i)
        for static, value in ((q, fresh_q), (k, fresh_k), (v, fresh_v), (cache, start)):
            static.copy_(value)
        for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
            getattr(meta, name).copy_(getattr(live, name))
        eager_cache = start.clone()
        want = _op(fresh_q, fresh_k, fresh_v, eager_cache, live)
        g.replay()
        torch.testing.assert_close(out, want, atol=ATOL, rtol=0)
        assert torch.equal(cache, eager_cache)
    assert g.replays == 3


def test_op_is_a_declared_capturable_attention_break() -> None:
    from ppcompile.analysis.op_matching import ATTENTION_LAYER_ARGS

    assert ATTENTION_LAYER_ARGS["ppcompile::paged_attention"] == "layer_id"
    entry = capturable_break("ppcompile::paged_attention")
    assert entry is not None and entry.refused is None
    assert {name: (meta.rows, meta.pad) for name, meta in entry.metadata.items()} == {
        "query_start_loc": (Rows.REQUEST_STARTS, 0), "seq_lens": (Rows.REQUESTS, 0),
        "block_table": (Rows.REQUESTS, 0), "slot_mapping": (Rows.TOKENS, -1)}


# ----------------------------------------------------------------------------------------- metadata
def test_make_paged_metadata_values() -> None:
    m = _meta([3, 2], [5, 0])
    assert m.query_start_loc.tolist() == [0, 3, 5] and m.query_start_loc.dtype == torch.int32
    assert m.seq_lens.tolist() == [8, 2] and m.seq_lens.dtype == torch.int32
    assert m.block_table.shape == (2, M) and m.block_table.dtype == torch.int32
    assert len(set(m.block_table.flatten().tolist())) == 2 * M  # distinct blocks
    t = m.block_table.long()
    want = [int(t[0, p // BS]) * BS + p % BS for p in (5, 6, 7)] + [int(t[1, 0]) * BS, int(t[1, 0]) * BS + 1]
    assert m.slot_mapping.tolist() == want and m.slot_mapping.dtype == torch.int64
    unshuffled = torch.arange(2 * M, dtype=torch.int32).view(2, M)
    assert torch.equal(_meta([1, 1], seed=None).block_table, unshuffled)
    assert torch.equal(_meta([1, 1]).block_table, _meta([4, 7], [2, 9]).block_table)  # per request index
    assert paged_positions([3, 2], [5, 0]).tolist() == [5, 6, 7, 0, 1]
    assert paged_positions([2]).tolist() == [0, 1]


@pytest.mark.parametrize(("new", "prefix", "kwargs", "match"), [
    ([], None, {}, "non-empty and positive"),
    ([2, 0], None, {}, "non-empty and positive"),
    ([2], [1, 1], {}, "prefix_lens has 2 entries"),
    ([2], [-1], {}, "prefix_lens must be >= 0"),
    ([BS * M], [1], {}, "longer than blocks_per_request"),
    ([1] * 6, None, {}, "not enough blocks"),
    ([1], None, {"block_size": 0}, "block_size must be a positive int"),
])
def test_make_paged_metadata_rejects(new: list[int], prefix: list[int] | None, kwargs: dict[str, int],
                                     match: str) -> None:
    sizes = {"block_size": BS, "blocks_per_request": M, "num_blocks": BLOCKS, **kwargs}
    with pytest.raises(ValueError, match=match):
        make_paged_metadata(new, prefix, block_size=sizes["block_size"],
                            blocks_per_request=sizes["blocks_per_request"], num_blocks=sizes["num_blocks"])


# ----------------------------------------------------------------------------------------- the model
PAGED = ModelConfig(num_layers=2, paged_attention=True)


def test_config_and_stage_validation() -> None:
    for bad in ({"attention_with_output": True}, {"compile_regions": True}, {"block_size": 0},
                {"kv_blocks": -1}):
        with pytest.raises(ValueError, match="ModelConfig"):
            PAGED.replace(**bad)
    stage = make_stage(PAGED, 0, 1)
    cache = stage.layers[1].self_attn.kv_cache  # type: ignore[union-attr]
    assert cache.shape == (PAGED.kv_blocks * PAGED.block_size, 2, 2, 16)
    assert not any("kv_cache" in name for name in stage.state_dict())
    assert not hasattr(make_stage(PAGED.replace(paged_attention=False), 0, 1).layers[0].self_attn, "kv_cache")
    ids, pos, _, _ = make_paged_batch(PAGED, [3], None, 0, 1)
    with pytest.raises(ValueError, match="attn_metadata"):
        stage(ids, pos)


def _chain(stages: Sequence[torch.nn.Module], cfg: ModelConfig, new: Sequence[int],
           prefix: Sequence[int] | None) -> torch.Tensor:
    ids, pos, _, meta = make_paged_batch(cfg, new, prefix, 0, len(stages), seed=sum(new))
    out: torch.Tensor | PPProxyTensors = stages[0](ids, pos, None, meta)
    for stage in stages[1:]:
        assert isinstance(out, PPProxyTensors)
        out = stage(None, pos, out, meta)
    assert isinstance(out, torch.Tensor)
    return out


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("pp_size", [1, 2])
def test_compiled_paged_stages_match_eager_without_recompiles(pp_size: int) -> None:
    """Each case first prefills its prefixes (the KV the next call reads), in eager and compiled stages
    with caches of their own. Calls of 2+ requests and tokens share one stage graph per stage (metadata
    are graph inputs with symbolic sizes); one request and one token are Dynamo's 0/1 specialisations."""
    eager = [make_stage(PAGED, r, pp_size) for r in range(pp_size)]
    options: dict[str, Any] = {"capture_sizes": [8, 16, 32]}
    compiled: list[Any] = [torch.compile(make_stage(PAGED, r, pp_size), backend="pp_breakable", dynamic=True,
                                         options=options) for r in range(pp_size)]
    shared: list[tuple[list[int], list[int] | None]] = [
        ([3, 2], None), ([5, 4], [3, 2]), ([2, 3, 3], [1, 4, 2]), ([20, 12, 8], [4, 1, 7]), ([4, 4, 1], None)]
    special: list[tuple[list[int], list[int] | None]] = [([5], [6]), ([1], [5])]
    with torch.inference_mode():
        for i, (new, prefix) in enumerate(shared + special):
            calls = ([(prefix, None)] if prefix else []) + [(new, prefix)]
            for n, p in calls:
                want = _chain(eager, PAGED, n, p)
                got = _chain(compiled, PAGED, n, p)
                torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=f"{n} after {p}")
            if i == len(shared) - 1:
                assert [len(ppcompile.runtimes_of(c)) for c in compiled] == [1] * pp_size
    for c in compiled:
        runtimes = ppcompile.runtimes_of(c)
        assert len(runtimes) == 3  # 2+ requests and tokens, 1 request, 1 token
        reasons = runtimes[0].break_reasons
        assert [r.kind for r in reasons] == [BreakKind.ATTENTION] * (PAGED.num_layers // pp_size)
        assert all("paged_attention" in str(r) for r in reasons), runtimes[0].describe()

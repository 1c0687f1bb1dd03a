"""The capturable paged attention op of the reference models, and the metadata it reads.

``torch.ops.ppcompile.paged_attention`` reads all its per-forward metadata from tensor arguments (no Python
ints that vary per forward, no forward context, no host syncs) and its prefix KV from a paged KV cache, so
a whole stage, attention included, can be captured as one CUDA graph per token bucket and replayed with
padded metadata (``ppcompile.capturable``). It is the reference op: simple and capture-safe (fixed shapes,
no loop over requests, no ``.item()``), not fast: every row gathers its request's whole block table.

Metadata (:class:`PagedMetadata`), for ``R`` requests of ``T`` new tokens packed in request order:

* ``query_start_loc`` int32 ``[R + 1]``: prefix sums of the new tokens per request;
* ``seq_lens`` int32 ``[R]``: total KV length per request (prefix length + new tokens);
* ``block_table`` int32 ``[R, M]``: the KV blocks of each request (position ``j`` lives in slot
  ``block_table[r, j // block_size] * block_size + j % block_size``);
* ``slot_mapping`` int64 ``[T]``: the KV slot each new token writes (``-1``: writes nothing).

Padding (what the capturable declaration promises): a row at or beyond ``query_start_loc[-1]`` belongs to
no request and outputs exactly 0; a row with slot ``-1`` writes nothing; a zero-length request (its start
repeated, ``seq_len`` 0) reads and writes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ppcompile.analysis.op_matching import register_attention_op
from ppcompile.capturable import Metadata, Rows, declare_capturable
from ppcompile.torch_internals import shape_check

__all__ = ["PagedMetadata", "make_paged_metadata", "paged_attention", "paged_positions"]


@dataclass
class PagedMetadata:
    """The per-forward metadata of :func:`paged_attention` (see the module docstring)."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


def _lens(new_lens: Sequence[int], prefix_lens: Sequence[int] | None) -> tuple[list[int], list[int]]:
    """``new_lens`` and ``prefix_lens`` (zeros when None) as validated int lists."""
    new = [int(n) for n in new_lens]
    prefix = [0] * len(new) if prefix_lens is None else [int(p) for p in prefix_lens]
    if not new or any(n <= 0 for n in new):
        raise ValueError(f"paged metadata: new_lens must be non-empty and positive, got {new}")
    if len(prefix) != len(new):
        raise ValueError(f"paged metadata: prefix_lens has {len(prefix)} entries for {len(new)} requests")
    if any(p < 0 for p in prefix):
        raise ValueError(f"paged metadata: prefix_lens must be >= 0, got {prefix}")
    return new, prefix


def paged_positions(
    new_lens: Sequence[int], prefix_lens: Sequence[int] | None = None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Absolute positions int64 ``[T]`` of the new tokens: ``prefix_len + offset`` within each request."""
    new, prefix = _lens(new_lens, prefix_lens)
    return torch.cat([torch.arange(p, p + n, dtype=torch.int64) for n, p in zip(new, prefix)]).to(device)


def make_paged_metadata(
    new_lens: Sequence[int],
    prefix_lens: Sequence[int] | None = None,
    *,
    block_size: int,
    blocks_per_request: int,
    num_blocks: int,
    device: torch.device | str = "cpu",
    shuffle_seed: int | None = None,
) -> PagedMetadata:
    """Metadata for requests of ``new_lens`` new tokens after ``prefix_lens`` cached ones (default 0).

    Request ``r`` owns the ``blocks_per_request`` distinct blocks ``r * M .. (r + 1) * M - 1`` of the
    block ids ``0 .. num_blocks - 1``, permuted by ``shuffle_seed`` when given; the assignment depends on
    the request index only, so a later call for the same requests (a longer prefix) finds the KV an earlier
    one wrote. Raises ``ValueError`` for bad lengths, too few blocks, or a request longer than its
    ``blocks_per_request * block_size`` slots."""
    new, prefix = _lens(new_lens, prefix_lens)
    for name, value in (("block_size", block_size), ("blocks_per_request", blocks_per_request),
                        ("num_blocks", num_blocks)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"make_paged_metadata: {name} must be a positive int, got {value!r}")
    capacity = blocks_per_request * block_size
    too_long = [i for i, (n, p) in enumerate(zip(new, prefix)) if n + p > capacity]
    if too_long:
        raise ValueError(
            f"make_paged_metadata: requests {too_long} are longer than blocks_per_request * block_size = "
            f"{capacity} slots (new_lens={new}, prefix_lens={prefix})")
    if len(new) * blocks_per_request > num_blocks:
        raise ValueError(
            f"make_paged_metadata: not enough blocks: {len(new)} requests x {blocks_per_request} blocks "
            f"per request > num_blocks={num_blocks}")
    ids = torch.arange(num_blocks, dtype=torch.int64)
    if shuffle_seed is not None:
        ids = ids[torch.randperm(num_blocks, generator=torch.Generator().manual_seed(shuffle_seed))]
    table = ids[: len(new) * blocks_per_request].view(len(new), blocks_per_request)
    slots = []
    for r, (n, p) in enumerate(zip(new, prefix)):
        pos = torch.arange(p, p + n, dtype=torch.int64)
        slots.append(table[r, pos // block_size] * block_size + pos % block_size)
    starts = torch.tensor([0, *new], dtype=torch.int64).cumsum(0)
    return PagedMetadata(
        query_start_loc=starts.to(device=device, dtype=torch.int32),
        seq_lens=torch.tensor([n + p for n, p in zip(new, prefix)], dtype=torch.int32, device=device),
        block_table=table.to(device=device, dtype=torch.int32),
        slot_mapping=torch.cat(slots).to(device),
    )


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                  slot_mapping: torch.Tensor, block_size: int) -> None:
    """Shape relations of the op's arguments (``shape_check``, torch's ``_check``: under tracing they also
    tell the shape environment that ``slot_mapping``'s rows are the tokens and the metadata's the
    requests)."""
    t, hq, d = q.shape
    hkv, r = k.shape[1], seq_lens.shape[0]
    shape_check(k.dim() == 3 and v.dim() == 3 and k.shape[0] == t and k.shape[2] == d and v.shape[0] == t
                 and v.shape[1] == hkv and v.shape[2] == d,
                 lambda: f"paged_attention: k {list(k.shape)}, v {list(v.shape)} unlike q {list(q.shape)}")
    shape_check(hq % hkv == 0, lambda: f"paged_attention: {hq} query heads are no multiple of {hkv}")
    shape_check(kv_cache.dim() == 4 and kv_cache.shape[1] == 2 and kv_cache.shape[2] == hkv
                 and kv_cache.shape[3] == d,
                 lambda: f"paged_attention: kv_cache {list(kv_cache.shape)} is not [slots, 2, {hkv}, {d}]")
    shape_check(kv_cache.shape[0] % block_size == 0,
                 lambda: f"paged_attention: {kv_cache.shape[0]} cache slots are no multiple of {block_size}")
    shape_check(slot_mapping.dim() == 1 and slot_mapping.shape[0] == t,
                 lambda: f"paged_attention: slot_mapping {list(slot_mapping.shape)} for {t} tokens")
    shape_check(query_start_loc.dim() == 1 and query_start_loc.shape[0] == r + 1,
                 lambda: f"paged_attention: query_start_loc {list(query_start_loc.shape)} for {r} requests")
    shape_check(block_table.dim() == 2 and block_table.shape[0] == r,
                 lambda: f"paged_attention: block_table {list(block_table.shape)} for {r} requests")


def _write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``kv_cache[slot] = (k, v)`` for the rows whose slot is >= 0, with fixed shapes and no sync.

    Every row writes: a row without a slot rewrites what the first row with one writes (or, when no row
    has one, slot 0's old content), so duplicate indices always carry identical values."""
    new = torch.stack([k, v], dim=1).to(kv_cache.dtype)  # [T, 2, Hkv, D]
    valid = slot_mapping >= 0
    first = torch.argmax(valid.to(torch.int32)).view(1)  # the first valid row (0 when none is)
    any_valid = valid.index_select(0, first)  # [1]
    fallback = torch.where(any_valid, slot_mapping.index_select(0, first), 0)  # [1]
    old = kv_cache.index_select(0, fallback)  # [1, 2, Hkv, D]
    fallback_value = torch.where(any_valid.view(1, 1, 1, 1), new.index_select(0, first), old)
    index = torch.where(valid, slot_mapping, fallback)
    value = torch.where(valid.view(-1, 1, 1, 1), new, fallback_value)
    kv_cache.index_put_((index,), value)


@torch.library.custom_op("ppcompile::paged_attention", mutates_args=("kv_cache",))
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    layer_id: int,
    block_size: int,
) -> torch.Tensor:
    """Writes k/v to ``kv_cache`` at ``slot_mapping`` then runs causal GQA attention of each request's new
    tokens over its KV read through ``block_table`` (module docstring); rows of no request output 0.

    ``q``: ``[T, Hq, D]``; ``k``/``v``: ``[T, Hkv, D]``; ``kv_cache``: ``[num_blocks * block_size, 2, Hkv,
    D]`` (0 key, 1 value). ``layer_id`` (the global layer id) only names the layer. Returns ``[T, Hq, D]``.
    """
    _check_shapes(q, k, v, kv_cache, query_start_loc, seq_lens, block_table, slot_mapping, block_size)
    t, hq, d = q.shape
    hkv = k.shape[1]
    r = seq_lens.shape[0]
    if t == 0:
        return q.new_zeros(q.shape)
    _write_kv(kv_cache, k, v, slot_mapping)
    if r == 0:
        return q.new_zeros(q.shape)
    device = q.device
    rows = torch.arange(t, device=device, dtype=query_start_loc.dtype)
    ends = query_start_loc[1:].contiguous()
    req = torch.searchsorted(ends, rows, right=True).clamp_(max=r - 1)  # [T] the request of each row
    live = rows < query_start_loc[-1:]  # [T] rows of a request
    start = query_start_loc.index_select(0, req).long()
    q_len = ends.index_select(0, req).long() - start
    pos = seq_lens.index_select(0, req).long() - q_len + (rows.long() - start)  # [T] absolute position
    span = block_table.shape[1] * block_size
    slot_of = torch.arange(block_size, device=device)
    table = block_table.index_select(0, req).long()  # [T, M]
    slots = (table.unsqueeze(-1) * block_size + slot_of).reshape(t, span)  # [T, L]
    keys = kv_cache[:, 0].index_select(0, slots.reshape(-1)).view(t, span, hkv, d).float()
    values = kv_cache[:, 1].index_select(0, slots.reshape(-1)).view(t, span, hkv, d).float()
    j = torch.arange(span, device=device)
    # a row of no request attends to position 0 only, so its softmax is finite; its output is zeroed
    mask = torch.where(live.unsqueeze(-1), j <= pos.unsqueeze(-1), j == 0)  # [T, L]
    qf = q.float().view(t, hkv, hq // hkv, d)
    scores = torch.einsum("thgd,tlhd->thgl", qf, keys) * (1.0 / math.sqrt(d))
    scores = scores.masked_fill(~mask.view(t, 1, 1, span), float("-inf"))
    out = torch.einsum("thgl,tlhd->thgd", torch.softmax(scores, dim=-1), values).reshape(t, hq, d)
    return torch.where(live.view(t, 1, 1), out, 0.0).to(q.dtype)


@paged_attention.register_fake
def _paged_attention_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    layer_id: int,
    block_size: int,
) -> torch.Tensor:
    _check_shapes(q, k, v, kv_cache, query_start_loc, seq_lens, block_table, slot_mapping, block_size)
    return torch.empty_like(q)


register_attention_op("ppcompile::paged_attention", "layer_id")
declare_capturable(
    paged_attention._opoverload,
    metadata={
        "query_start_loc": Metadata(Rows.REQUEST_STARTS),
        "seq_lens": Metadata(Rows.REQUESTS, pad=0),
        "block_table": Metadata(Rows.REQUESTS, pad=0),
        "slot_mapping": Metadata(Rows.TOKENS, pad=-1),
    },
)

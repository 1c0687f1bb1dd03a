"""The opaque attention op of the reference models and the forward context it reads.

``torch.ops.ppcompile.attention(q, k, v, layer_id)`` is a custom op: Dynamo and the backend see one call
per layer with the **global** layer id as a constant int, never its body. The body reads the varlen
metadata and the KV cache of that layer from the forward context set by :func:`set_forward_context`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ppcompile.models.config import ModelConfig

__all__ = [
    "ForwardContext",
    "attention",
    "attention_with_output",
    "get_forward_context",
    "make_forward_context",
    "set_forward_context",
]


@dataclass
class ForwardContext:
    """Per-forward attention metadata for a packed varlen batch.

    ``seq_lens``: live sequence lengths (python ints); ``cu_seqlens``: int32 ``[num_seqs + 1]`` prefix sums;
    ``slot_mapping``: int64 ``[T]`` KV-cache slot of each token; ``kv_caches``: global layer id ->
    ``[num_slots, 2, num_kv_heads, head_dim]`` (index 0 = key, 1 = value).
    """

    seq_lens: list[int]
    cu_seqlens: torch.Tensor
    slot_mapping: torch.Tensor
    kv_caches: dict[int, torch.Tensor]

    @property
    def num_tokens(self) -> int:
        """Live token count ``T`` (``sum(seq_lens)``, equal to ``cu_seqlens[-1]``)."""
        return sum(self.seq_lens)

    def __post_init__(self) -> None:
        if any(n <= 0 for n in self.seq_lens):
            raise ValueError(f"ForwardContext.seq_lens must all be positive, got {self.seq_lens}")
        if tuple(self.cu_seqlens.shape) != (len(self.seq_lens) + 1,):
            raise ValueError(
                f"ForwardContext.cu_seqlens must have shape ({len(self.seq_lens) + 1},) for "
                f"{len(self.seq_lens)} sequences, got {tuple(self.cu_seqlens.shape)}"
            )
        if tuple(self.slot_mapping.shape) != (self.num_tokens,):
            raise ValueError(
                f"ForwardContext.slot_mapping must have shape ({self.num_tokens},), "
                f"got {tuple(self.slot_mapping.shape)}"
            )


_CONTEXT: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make ``ctx`` the forward context for the duration of the ``with`` block (nesting restores)."""
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, ctx
    try:
        yield ctx
    finally:
        _CONTEXT = previous


def get_forward_context() -> ForwardContext:
    """The current forward context; raises ``RuntimeError`` outside :func:`set_forward_context`."""
    if _CONTEXT is None:
        raise RuntimeError(
            "ppcompile::attention ran without a forward context: wrap the model call in "
            "`with set_forward_context(make_forward_context(seq_lens, cfg, layer_ids)):`"
        )
    return _CONTEXT


def make_forward_context(
    seq_lens: Sequence[int],
    cfg: ModelConfig,
    layer_ids: Iterable[int],
    device: torch.device | str = "cpu",
    num_slots: int | None = None,
    tp_size: int = 1,
) -> ForwardContext:
    """A context for ``seq_lens`` with slots ``0..T-1`` and zeroed KV caches for the global ``layer_ids``
    (for one rank of a ``tp_size``-way tensor-parallel group: its ``num_kv_heads / tp_size`` heads)."""
    lens = [int(n) for n in seq_lens]
    total = sum(lens)
    slots = total if num_slots is None else num_slots
    if slots < total:
        raise ValueError(f"make_forward_context: num_slots={slots} is smaller than the {total} tokens")
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0).to(torch.int32)
    caches = {
        int(i): torch.zeros(slots, 2, cfg.num_kv_heads // tp_size, cfg.head_dim, dtype=cfg.dtype,
                            device=device)
        for i in layer_ids
    }
    return ForwardContext(
        seq_lens=lens,
        # non_blocking: a blocking host-to-device copy synchronises the host with the device, once per
        # forward; from pageable memory the copy is staged before cudaMemcpyAsync returns, so ``cu`` may go.
        cu_seqlens=cu.to(device, non_blocking=True),
        slot_mapping=torch.arange(total, dtype=torch.int64, device=device),
        kv_caches=caches,
    )


def _attend_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer_id: int,
                 op: str) -> None:
    """Writes k/v to ``kv_caches[layer_id]`` and causal GQA attention per sequence into ``out``."""
    ctx = get_forward_context()
    if q.shape[0] != ctx.num_tokens:
        raise RuntimeError(
            f"{op} (layer {layer_id}) got {q.shape[0]} rows but the batch has "
            f"{ctx.num_tokens} tokens (seq_lens={ctx.seq_lens}); the op must see exactly the live tokens"
        )
    if out.shape != q.shape:
        raise RuntimeError(f"{op} (layer {layer_id}): out has shape {list(out.shape)}, q {list(q.shape)}")
    try:
        cache = ctx.kv_caches[layer_id]
    except KeyError:
        raise RuntimeError(
            f"{op}: no KV cache for global layer id {layer_id}; the forward context has "
            f"caches for layer ids {sorted(ctx.kv_caches)}"
        ) from None
    cache[ctx.slot_mapping, 0] = k.to(cache.dtype)
    cache[ctx.slot_mapping, 1] = v.to(cache.dtype)

    groups = q.shape[1] // k.shape[1]
    start = 0
    for n in ctx.seq_lens:
        # [1, Hq, n, D]: SDPA's fused kernels (flash, memory-efficient) take 4-D inputs only; 3-D ones fall
        # back to the math kernel, which materialises the n x n scores.
        qs = q[start : start + n].transpose(0, 1).unsqueeze(0)
        ks = k[start : start + n].repeat_interleave(groups, dim=1).transpose(0, 1).unsqueeze(0)
        vs = v[start : start + n].repeat_interleave(groups, dim=1).transpose(0, 1).unsqueeze(0)
        attended = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        out[start : start + n] = attended.squeeze(0).transpose(0, 1)
        start += n


@torch.library.custom_op("ppcompile::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
    """Causal GQA attention per sequence of a packed batch; also writes k/v to ``kv_caches[layer_id]``.

    ``q``: ``[T, Hq, D]``, ``k``/``v``: ``[T, Hkv, D]``; returns a new ``[T, Hq, D]`` tensor.
    """
    out = torch.empty_like(q)
    _attend_into(q, k, v, out, layer_id, "ppcompile::attention")
    return out


@attention.register_fake
def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
    return torch.empty_like(q)


@torch.library.custom_op("ppcompile::attention_with_output", mutates_args=("out",))
def attention_with_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          layer_id: int) -> None:
    """:func:`attention` written into ``out`` (``[T, Hq, D]``), an out-variant op like vLLM's
    ``unified_attention_with_output``: the caller allocates the output, so under ``pp_breakable`` the graph
    segment before it does, and the graph after it reads that memory with no bridge copy."""
    _attend_into(q, k, v, out, layer_id, "ppcompile::attention_with_output")


@attention_with_output.register_fake
def _attention_with_output_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                                layer_id: int) -> None:
    return None

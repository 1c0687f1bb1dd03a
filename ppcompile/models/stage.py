"""``PPStage``: one pipeline-parallel stage of the reference decoder, with deterministic weights."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
from torch import nn

from ppcompile.models.config import ModelConfig
from ppcompile.models.layers import DecoderLayer, PPMissingLayer, RMSNorm
from ppcompile.models.paged_attention import PagedMetadata, make_paged_metadata, paged_positions
from ppcompile.models.tensor_parallel import NO_TP, TensorParallel, shard_state_dict
from ppcompile.proxy import PPProxyTensors

__all__ = ["PPStage", "get_pp_indices", "make_batch", "make_paged_batch", "make_stage"]


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Global layer range ``[start, end)`` of stage ``pp_rank``.

    Rule: every stage gets ``num_layers // pp_size`` contiguous layers and the ``num_layers % pp_size``
    remainder layers go one each to the LAST stages (e.g. 10 layers over 4 stages -> 2, 2, 3, 3).
    """
    if pp_size < 1:
        raise ValueError(f"get_pp_indices: pp_size must be >= 1, got {pp_size}")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"get_pp_indices: pp_rank must be in [0, {pp_size}), got {pp_rank}")
    if num_layers < pp_size:
        raise ValueError(
            f"get_pp_indices: num_layers={num_layers} cannot be split over pp_size={pp_size} stages "
            "(every stage needs at least one layer)"
        )
    base, rem = divmod(num_layers, pp_size)
    first_big = pp_size - rem  # ranks >= first_big own base + 1 layers
    start = pp_rank * base + max(0, pp_rank - first_big)
    end = start + base + (1 if pp_rank >= first_big else 0)
    return start, end


class PPStage(nn.Module):
    """Layers ``[start_layer, end_layer)`` of the reference decoder; other ``layers[i]`` are placeholders.

    The first stage embeds ``input_ids``; the others read ``pp_proxy_tensors`` (``hidden_states``,
    ``residual`` unless ``hidden_only``, ``topk_indices`` when ``topk_proxy > 0``). Non-last stages return
    ``PPProxyTensors``; the last returns logits ``[T, vocab_size]``.

    With ``tp`` the stage is rank ``tp.rank`` of a tensor-parallel group (``models.tensor_parallel``): it
    holds its shards, all-reduces partial sums inside each layer and gathers the logits, so every rank of
    the group receives, returns and hands over the same full-width tensors.
    """

    def __init__(self, cfg: ModelConfig, pp_rank: int, pp_size: int, tp: TensorParallel = NO_TP) -> None:
        super().__init__()
        tp.check(cfg)
        self.config = cfg
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        self.tp = tp
        self.start_layer, self.end_layer = get_pp_indices(cfg.num_layers, pp_rank, pp_size)
        self.is_first = pp_rank == 0
        self.is_last = pp_rank == pp_size - 1
        vocab = tp.part(cfg.vocab_size)  # this rank's vocabulary range (all of it without TP)
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size) if self.is_first else None
        self.topk_embed = (
            nn.Embedding(cfg.hidden_size, cfg.hidden_size) if cfg.topk_proxy and not self.is_first else None
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, tp) if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps) if self.is_last else None
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False) if self.is_last else None

    def _proxy(self, proxies: PPProxyTensors | None, key: str) -> torch.Tensor:
        if proxies is None or key not in proxies:
            have = None if proxies is None else list(proxies)
            raise ValueError(
                f"PPStage rank {self.pp_rank}/{self.pp_size}: pp_proxy_tensors must contain {key!r}, "
                f"got keys {have}"
            )
        return proxies[key]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding of ``input_ids``; with TP, looked up in this rank's vocabulary range (zero rows
        for the other ids) and summed over the group."""
        assert self.embed_tokens is not None
        if self.tp.size == 1:
            return self.embed_tokens(input_ids)
        first = self.tp.rank * self.embed_tokens.num_embeddings
        local = input_ids - first
        mine = (local >= 0) & (local < self.embed_tokens.num_embeddings)
        rows = self.embed_tokens(local * mine) * mine.unsqueeze(-1).to(self.embed_tokens.weight.dtype)
        return self.tp.all_reduce(rows)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        pp_proxy_tensors: PPProxyTensors | None = None,
        attn_metadata: PagedMetadata | None = None,
    ) -> torch.Tensor | PPProxyTensors:
        cfg = self.config
        if cfg.paged_attention and attn_metadata is None:
            raise ValueError(f"PPStage rank {self.pp_rank}/{self.pp_size}: cfg.paged_attention needs "
                             "attn_metadata (models.paged_attention.PagedMetadata), got None")
        residual: torch.Tensor | None = None
        if self.embed_tokens is not None:
            if input_ids is None:
                raise ValueError(f"PPStage rank 0/{self.pp_size}: the first stage needs input_ids, got None")
            hidden = self._embed(input_ids)
        else:
            hidden = self._proxy(pp_proxy_tensors, "hidden_states")
            if not cfg.hidden_only:
                residual = self._proxy(pp_proxy_tensors, "residual")
            if self.topk_embed is not None:
                hidden = hidden + self.topk_embed(self._proxy(pp_proxy_tensors, "topk_indices")).sum(1)

        for i in range(self.start_layer, self.end_layer):
            if cfg.hidden_only:
                hidden = self.layers[i](positions, hidden, attn_metadata=attn_metadata)
            else:
                hidden, residual = self.layers[i](positions, hidden, residual, attn_metadata)

        if self.norm is not None and self.lm_head is not None:
            normed = self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]
            return self.tp.gather_last_dim(self.lm_head(normed))
        out = {"hidden_states": hidden}
        if residual is not None:
            out["residual"] = residual
        if cfg.topk_proxy:
            out["topk_indices"] = torch.topk(hidden, cfg.topk_proxy, dim=-1).indices.to(torch.int32)
        return PPProxyTensors(out)


def _generator(cfg: ModelConfig, tag: str) -> torch.Generator:
    """A CPU generator seeded from ``(cfg.seed, tag)`` only, so weights do not depend on the PP split."""
    return torch.Generator().manual_seed(zlib.crc32(f"{cfg.seed}:{tag}".encode()))


def _init_(module: nn.Module, cfg: ModelConfig, tag: str) -> None:
    """Fill ``module``'s parameters deterministically from ``(cfg.seed, tag)``.

    Input projections get std ``fan_in**-0.5`` (outputs O(1)); output projections (``o_proj``,
    ``down_proj``) are further scaled by ``(2 * num_layers)**-0.5`` so the residual stream stays O(1)
    through deep models; norms get ``1 + 0.1 * N(0, 1)``; embeddings ``N(0, 1)`` (topk: scaled down).
    """
    gen = _generator(cfg, tag)
    for mod_name, mod in module.named_modules():
        for p in mod.parameters(recurse=False):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if isinstance(mod, RMSNorm):
                value = 1.0 + 0.1 * noise
            elif isinstance(mod, nn.Embedding):
                value = noise * (0.5 * max(cfg.topk_proxy, 1) ** -0.5 if tag.startswith("topk") else 1.0)
            else:
                std = p.shape[-1] ** -0.5
                if mod_name.endswith(("o_proj", "down_proj")):
                    std *= (2 * cfg.num_layers) ** -0.5
                value = noise * std
            with torch.no_grad():
                p.copy_(value.to(p.dtype))


def make_stage(
    cfg: ModelConfig, pp_rank: int, pp_size: int, device: torch.device | str = "cpu",
    tp: TensorParallel = NO_TP,
) -> PPStage:
    """Stage ``pp_rank`` of ``pp_size`` with weights seeded by ``(cfg.seed, global layer id)``.

    Layer ``i`` has the same weights whichever stage owns it, so the stages of any split compose to the
    same full model (``make_stage(cfg, 0, 1)``). The ``topk_embed`` of a non-first stage is seeded by its
    ``start_layer``. With ``tp``, rank ``tp.rank``'s shards of those same weights, so any TP size computes
    the full model. Returned in eval mode with ``requires_grad_(False)``.
    """
    stage = _full_stage(cfg, pp_rank, pp_size)
    if tp.size > 1:
        sharded = PPStage(cfg, pp_rank, pp_size, tp)
        sharded.load_state_dict(shard_state_dict(stage.state_dict(), cfg, tp))
        stage = sharded
    return stage.to(device=device, dtype=cfg.dtype).eval().requires_grad_(False)


def _full_stage(cfg: ModelConfig, pp_rank: int, pp_size: int) -> PPStage:
    stage = PPStage(cfg, pp_rank, pp_size)
    if stage.embed_tokens is not None:
        _init_(stage.embed_tokens, cfg, "embed_tokens")
    if stage.topk_embed is not None:
        _init_(stage.topk_embed, cfg, f"topk_embed:{stage.start_layer}")
    for i in range(stage.start_layer, stage.end_layer):
        _init_(stage.layers[i], cfg, f"layer:{i}")
    if stage.norm is not None and stage.lm_head is not None:
        _init_(stage.norm, cfg, "final_norm")
        _init_(stage.lm_head, cfg, "lm_head")
    return stage


def make_batch(
    cfg: ModelConfig,
    seq_lens: Sequence[int],
    pp_rank: int,
    pp_size: int,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor | None, torch.Tensor, PPProxyTensors | None]:
    """Random ``(input_ids, positions, pp_proxy_tensors)`` for a varlen batch of ``seq_lens`` at a stage.

    ``input_ids`` only for the first stage, proxies only for the others; positions restart at 0 for each
    sequence.
    """
    if not seq_lens or any(n <= 0 for n in seq_lens):
        raise ValueError(f"make_batch: seq_lens must be non-empty and positive, got {list(seq_lens)}")
    get_pp_indices(cfg.num_layers, pp_rank, pp_size)  # validates the rank
    gen = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in seq_lens]).to(device)
    input_ids: torch.Tensor | None = None
    proxies: PPProxyTensors | None = None
    if pp_rank == 0:
        input_ids = torch.randint(0, cfg.vocab_size, (total,), generator=gen).to(device)
    else:
        shape = (total, cfg.hidden_size)
        tensors = {"hidden_states": torch.randn(shape, generator=gen).to(device, cfg.dtype)}
        if not cfg.hidden_only:
            tensors["residual"] = torch.randn(shape, generator=gen).to(device, cfg.dtype)
        if cfg.topk_proxy:
            idx = torch.randint(0, cfg.hidden_size, (total, cfg.topk_proxy), generator=gen)
            tensors["topk_indices"] = idx.to(device, torch.int32)
        proxies = PPProxyTensors(tensors)
    return input_ids, positions, proxies


def make_paged_batch(
    cfg: ModelConfig,
    new_lens: Sequence[int],
    prefix_lens: Sequence[int] | None,
    pp_rank: int,
    pp_size: int,
    seed: int = 0,
    device: torch.device | str = "cpu",
    shuffle_seed: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, PPProxyTensors | None, PagedMetadata]:
    """:func:`make_batch` for ``new_lens`` new tokens after ``prefix_lens`` cached ones (default 0), with
    absolute positions and the paged metadata of ``cfg``'s cache (``make_paged_metadata``)."""
    input_ids, _, proxies = make_batch(cfg, new_lens, pp_rank, pp_size, seed, device)
    meta = make_paged_metadata(new_lens, prefix_lens, block_size=cfg.block_size,
                               blocks_per_request=cfg.blocks_per_request, num_blocks=cfg.kv_blocks,
                               device=device, shuffle_seed=shuffle_seed)
    return input_ids, paged_positions(new_lens, prefix_lens, device), proxies, meta

"""What ``ppcompile.models.hf`` knows of each ``transformers`` family: layer kinds, declared blocks, the
families it refuses, and tiny random-weight configs for tests (``TINY_FAMILIES``, ``tiny_causal_lm``).

Import it through ``ppcompile.models.hf`` (which re-exports the public names and says how to install
``transformers`` when it is missing).
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch import nn

__all__ = ["ATTENTION_KINDS", "EAGER_CORES", "LAYER_MASKS", "TINY_FAMILIES",
           "TOKEN_LOCAL_BLOCKS", "UNSUPPORTED", "layer_kind", "tiny_causal_lm", "tiny_config"]

# ------------------------------------------------------------------------------------------ layer kinds
LAYER_MASKS: dict[str, tuple[str, ...]] = {
    "full_attention": ("full_attention",),
    "sliding_attention": ("sliding_attention",),
    "linear_attention": ("linear_attention",),  # gated DeltaNet, Mamba-2 mixers
    "conv": ("linear_attention",),  # LFM2's short convolution
    # Falcon-H1 runs attention and a Mamba-2 mixer side by side in every layer; a Zamba2 hybrid layer runs
    # the shared attention block, then its Mamba-2 mixer.
    "hybrid": ("full_attention", "linear_attention"),
}
"""Layer kind (``config.layer_types``) -> the HF masks its layers read (``linear_attention``: HF's recurrent
mask, ``None`` for unpadded prompts)."""
ATTENTION_KINDS = frozenset({"full_attention", "sliding_attention", "hybrid"})
"""Kinds whose layers read rotary position embeddings (when the model has them)."""
_LEGACY_KINDS = {"mamba": "linear_attention", "attention": "full_attention"}  # older layers_block_type names


def layer_kind(config: Any, layer: int) -> str:
    """The kind of global layer ``layer`` (``config.layer_types``, legacy names mapped as transformers
    5.24 maps them); without layer types, sliding or full attention by ``config.sliding_window``."""
    types = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
    if types:
        return _LEGACY_KINDS.get(str(types[layer]), str(types[layer]))
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


UNSUPPORTED: dict[str, str] = {}
"""``config.model_type`` -> why ``HFStage`` refuses the family (a ``ValueError`` naming the family and the
reason). Every family of ``TINY_FAMILIES`` is served; layer kinds outside ``LAYER_MASKS`` are refused too."""

# ------------------------------------------------------------------------------------------ declared blocks
# Sparse-MoE blocks that keep to the ``ppcompile.token_local`` contract in inference: top-k routing per
# token, no expert capacity, no statistics kept in forward (Mixtral's router jitter runs in training only).
TOKEN_LOCAL_BLOCKS = frozenset({
    "Qwen2MoeSparseMoeBlock", "MixtralSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "DeepseekV3MoE",
    "GptOssMLP", "Qwen3NextSparseMoeBlock", "GraniteMoeHybridMoE", "JambaSparseMoeBlock",
})
# Linear-attention layers -> the torch function of their chunked scan, in the layer's module. The scan pads
# the tokens to a multiple of the chunk size, folds them into chunks and back: row-mixing all through, so it
# is declared one eager region (``ppcompile.eager_region``) instead of a break per op.
EAGER_CORES = {"Qwen3NextGatedDeltaNet": "torch_chunk_gated_delta_rule"}

# ------------------------------------------------------------------------------------------ tiny configs
# Tiny shape shared by every family: 4 layers, GQA (4 query heads, 2 KV heads of dim 16).
_TINY_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 4096,
}
_MOE_SHAPE: dict[str, Any] = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# A Mamba-2 mixer of 8 heads of 16 (hidden 64, expand 2). The chunk size stays HF's (256): counts in one
# chunk-size class share a stage graph.
_MAMBA2: dict[str, Any] = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_n_groups": 1,
                           "mamba_expand": 2}
_TOKEN_IDS: dict[str, Any] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # inside the vocab
# Multipliers other than 1, so that a stage that forgot one would not equal the model.
_GRANITE_SCALES: dict[str, Any] = {"embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                                   "logits_scaling": 4.0, "attention_multiplier": 0.25}

TINY_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "qwen2_moe": ("Qwen2MoeConfig", {**_MOE_SHAPE, "shared_expert_intermediate_size": 64}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", _MOE_SHAPE),
    "deepseek_v3": ("DeepseekV3Config", {
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "n_group": 2, "topk_group": 1, "first_k_dense_replace": 0, "kv_lora_rank": 32, "q_lora_rank": 32,
        "num_key_value_heads": 4, "head_dim": 8, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
        "v_head_dim": 16,
    }),
    # transformers has no SDPA path for GPT-OSS (attention sinks): its attention is written in plain ops.
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
                                 "attn_implementation": "eager"}),
    # Hybrid: gated DeltaNet linear attention and full attention layers, alternating.
    "qwen3_next": ("Qwen3NextConfig", {
        **_MOE_SHAPE, "shared_expert_intermediate_size": 64, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4, "layer_types": ("linear_attention", "full_attention"),
    }),
    # Hybrids of a Mamba-2 mixer (HF's torch chunked scan, an opaque mixer) and full attention.
    "bamba": ("BambaConfig", {**_MAMBA2, "attn_layer_indices": [1]}),
    "granitemoehybrid": ("GraniteMoeHybridConfig", {
        **_MAMBA2, **_GRANITE_SCALES, "layer_types": ("linear_attention", "full_attention"),
        "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 64,
    }),
    # Every layer runs attention and a Mamba-2 mixer side by side.
    "falcon_h1": ("FalconH1Config", {
        **_MAMBA2, "mamba_d_ssm": 128, "embedding_multiplier": 2.0, "lm_head_multiplier": 0.5,
        "attention_in_multiplier": 0.5, "ssm_out_multiplier": 0.5,
    }),
    # Mamba-2 layers, and hybrid layers that run a shared attention block (on the hidden states and the
    # embeddings, concatenated; one block, its weights shared by every hybrid layer) before their mixer.
    # The heads are 2 * hidden / heads = 32 wide.
    "zamba2": ("Zamba2Config", {
        "layers_block_type": ("linear_attention", "hybrid"), "head_dim": 32, "mamba_d_state": 16,
        "mamba_headdim": 16, "n_mamba_heads": 8, "mamba_ngroups": 1, "use_mem_rope": True, **_TOKEN_IDS,
    }),
    # Mamba-2 layers only (no attention: transformers offers no SDPA for the family).
    "mamba2": ("Mamba2Config", {"num_heads": 8, "state_size": 16, "n_groups": 1, "expand": 2,
                                "attn_implementation": "eager"}),
    # Mamba (selective scan, an opaque mixer) and attention layers, MoE on every other layer.
    "jamba": ("JambaConfig", {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
                              "expert_layer_offset": 1, "num_experts": 4, "num_experts_per_tok": 2,
                              "mamba_d_state": 16, "mamba_dt_rank": 8}),
    # A short causal convolution (prefix-causal: graphed) and full attention.
    "lfm2": ("Lfm2Config", {"layer_types": ("conv", "full_attention")}),
    # Gemma 2 caps attention logits (softcapping), which SDPA cannot: transformers runs it in plain ops.
    "gemma2": ("Gemma2Config", {"attn_implementation": "eager", **_TOKEN_IDS}),
    "gemma3": ("Gemma3TextConfig", {"layer_types": ("sliding_attention", "full_attention"), **_TOKEN_IDS}),
    "cohere": ("CohereConfig", {"logit_scale": 0.5, "use_qk_norm": True, **_TOKEN_IDS}),
    "granite": ("GraniteConfig", _GRANITE_SCALES),
    "glm4": ("Glm4Config", _TOKEN_IDS),
    "starcoder2": ("Starcoder2Config", _TOKEN_IDS),
}
"""Family -> (``transformers`` config class name, fields on top of the shared tiny shape). A tuple of
``layer_types`` (``layers_block_type``) is a pattern, repeated over the layers."""


def tiny_config(family: str, **overrides: Any) -> Any:
    """A small config of ``family`` (a key of ``TINY_FAMILIES``) with ``attn_implementation="sdpa"`` (where
    transformers has it).

    ``overrides`` set any config field (``num_hidden_layers=2``, ``sliding_window=8``, ...).
    """
    try:
        class_name, extra = TINY_FAMILIES[family]
    except KeyError:
        raise ValueError(f"tiny_config: unknown family {family!r}; known: {sorted(TINY_FAMILIES)}") from None
    config_cls = getattr(transformers, class_name, None)
    if config_cls is None:
        raise ValueError(
            f"tiny_config: transformers {transformers.__version__} has no {class_name} (family {family!r}); "
            "pick another family or upgrade transformers"
        )
    fields = {**_TINY_SHAPE, "attn_implementation": "sdpa", **extra, **overrides}
    for key in ("layer_types", "layers_block_type"):
        if isinstance(fields.get(key), tuple):
            pattern = fields[key]
            fields[key] = [pattern[i % len(pattern)] for i in range(fields["num_hidden_layers"])]
    return config_cls(**fields)


def tiny_causal_lm(family: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """A random-weight causal LM of ``family`` from :func:`tiny_config` (nothing is downloaded), seeded by
    ``seed``, in eval mode with ``requires_grad_(False)``."""
    config = tiny_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.eval().requires_grad_(False)

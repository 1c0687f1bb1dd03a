"""Hugging Face ``transformers`` causal LMs as packed-token PP stages.

``HFStage(model, pp_rank, pp_size)`` runs layers ``[start, end)`` of a decoder-only ``transformers`` model
(Llama, Mistral, Qwen2, Qwen3, Qwen2-MoE, Mixtral, Qwen3-MoE, DeepSeek-V3, GPT-OSS, the hybrid Qwen3-Next,
...) with the house stage contract::

    forward(input_ids [T] | None, positions [T], pp_proxy_tensors) -> PPProxyTensors | logits [T, vocab]

The first stage embeds ``input_ids``; later stages read the ``hidden_states`` proxy ``[T, hidden]``; the
last applies the final norm and ``lm_head``. HF layers are batch-first, so the stage runs them on
``[1, T, hidden]`` (unsqueeze at entry, squeeze at exit): proxies and logits stay packed, token-major.

Attention is whatever the model's config selects. With ``attn_implementation="sdpa"`` each layer makes one
``scaled_dot_product_attention`` call (always a break in ``pp_breakable``). Masks come from
``transformers.masking_utils``, built as the HF model builds them: for one unpadded sequence the causal
mask is ``None`` (SDPA runs with ``is_causal=True``); sliding-window layers get their window mask once
the prompt reaches the window. ``varlen=True`` passes ``positions`` to the mask builder so that several
sequences packed into one forward (positions restarting at 0) attend only within themselves.
No KV cache: this is the prefill forward of whole prompts.

``transformers`` is optional (``pip install 'ppcompile[hf]'``); without it importing this module raises an
``ImportError`` that says so.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ppcompile.models.layers import PPMissingLayer, nested_region
from ppcompile.models.stage import get_pp_indices
from ppcompile.proxy import PPProxyTensors
from ppcompile.regions import eager_region, token_local

try:
    import transformers
    from transformers import masking_utils
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "ppcompile.models.hf needs the optional dependency 'transformers': "
        "pip install 'ppcompile[hf]' (or pip install transformers)"
    ) from e

__all__ = ["EAGER_CORES", "TINY_FAMILIES", "TOKEN_LOCAL_BLOCKS", "HFStage", "make_hf_stages",
           "tiny_causal_lm", "tiny_config"]

log = logging.getLogger(__name__)

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
    # Hybrid: a Mamba-2 mixer (HF's torch chunked scan, a library region) and a full attention layer. The
    # scan's chunk size stays HF's (256): counts in one chunk-size class share a stage graph.
    "bamba": ("BambaConfig", {
        "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_n_groups": 1,
        "mamba_expand": 2, "attn_layer_indices": [1],
    }),
    "qwen3_next": ("Qwen3NextConfig", {
        **_MOE_SHAPE, "shared_expert_intermediate_size": 64, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4, "layer_types": ("linear_attention", "full_attention"),
    }),
}
"""Family -> (``transformers`` config class name, fields on top of the shared tiny shape). A
``layer_types`` tuple is a pattern, repeated over the layers."""


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
    if isinstance(fields.get("layer_types"), tuple):
        pattern = fields["layer_types"]
        fields["layer_types"] = [pattern[i % len(pattern)] for i in range(fields["num_hidden_layers"])]
    return config_cls(**fields)


def tiny_causal_lm(family: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """A random-weight causal LM of ``family`` from :func:`tiny_config` (nothing is downloaded), seeded by
    ``seed``, in eval mode with ``requires_grad_(False)``."""
    config = tiny_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.eval().requires_grad_(False)


# Sparse-MoE blocks that keep to the ``ppcompile.token_local`` contract in inference: top-k routing per
# token, no expert capacity, no statistics kept in forward (Mixtral's router jitter runs in training only).
TOKEN_LOCAL_BLOCKS = frozenset({
    "Qwen2MoeSparseMoeBlock", "MixtralSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "DeepseekV3MoE",
    "GptOssMLP", "Qwen3NextSparseMoeBlock",
})
# Linear-attention layers -> the torch function of their chunked scan, in the layer's module. The scan pads
# the tokens to a multiple of the chunk size, folds them into chunks and back: row-mixing all through, so it
# is declared one eager region (``ppcompile.eager_region``) instead of a break per op.
EAGER_CORES = {"Qwen3NextGatedDeltaNet": "torch_chunk_gated_delta_rule"}


def _declare_regions(layer: nn.Module) -> None:
    """Declares what ppcompile knows of ``layer``'s blocks (``TOKEN_LOCAL_BLOCKS``, ``EAGER_CORES``)."""
    for block in layer.modules():
        name = type(block).__name__
        if name in TOKEN_LOCAL_BLOCKS:
            token_local(block)
        core = getattr(sys.modules.get(type(block).__module__), EAGER_CORES.get(name, ""), None)
        if core is not None:
            eager_region(_python_function(core))


def _python_function(core: Any) -> Any:
    """The Python function behind ``core``: itself, or the one a hub-kernel wrapper calls (transformers
    5.25 wraps such functions in a ``kernels`` module that calls the function from its ``forward``)."""
    if isinstance(core, nn.Module):
        cells = [c.cell_contents for c in type(core).forward.__closure__ or ()]
        core = next((c for c in cells if inspect.isfunction(c)), core)
    return core


# ------------------------------------------------------------------------------------------ masks
_MASK_BUILDERS: dict[str, Callable[..., Any]] = {
    "full_attention": masking_utils.create_causal_mask,
    "sliding_attention": masking_utils.create_sliding_window_causal_mask,
}
if hasattr(masking_utils, "create_recurrent_attention_mask"):  # transformers >= 5.x with hybrid models
    _MASK_BUILDERS["linear_attention"] = masking_utils.create_recurrent_attention_mask


_BUILDER_PARAMS = {kind: frozenset(inspect.signature(f).parameters) for kind, f in _MASK_BUILDERS.items()}


def _build_mask(
    kind: str, config: Any, hidden: torch.Tensor, position_ids: torch.Tensor | None
) -> torch.Tensor | None:
    """HF's mask for one layer type, across the keyword renames of ``transformers`` 4.5x -> 5.x."""
    params = _BUILDER_PARAMS[kind]
    kwargs: dict[str, Any] = {"config": config, "attention_mask": None, "position_ids": position_ids}
    kwargs["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = hidden
    kwargs["cache" if "cache" in params else "past_key_values"] = None
    if "cache_position" in params:  # transformers < 5
        kwargs["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
    return _MASK_BUILDERS[kind](**kwargs)


def _layer_type(config: Any, layer: int) -> str:
    types = getattr(config, "layer_types", None)
    if types:
        return str(types[layer])
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


def _decoder(model: nn.Module) -> Any:
    """The base decoder of a causal LM (``model.model`` for the Llama family), checked for its layout."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if not isinstance(base, nn.Module):
        raise TypeError(
            f"HFStage: {type(model).__name__} has no base model; pass a transformers *ForCausalLM model "
            "(AutoModelForCausalLM.from_config or from_pretrained)"
        )
    missing = [a for a in ("embed_tokens", "layers", "rotary_emb") if not hasattr(base, a)]
    missing += [] if _final_norm(base) is not None else ["norm"]
    missing += [] if hasattr(model, "lm_head") else ["lm_head"]
    if missing:
        raise TypeError(
            f"HFStage: {type(model).__name__} lacks the Llama-style layout this wrapper needs (missing "
            f"{missing}); supported models keep embed_tokens, layers, norm (or final_layernorm) and "
            "rotary_emb on the base model and lm_head on the LM (Llama, Mistral, Qwen2/3, Qwen2-MoE, "
            "Mixtral, Qwen3-MoE, Bamba)"
        )
    return base


def _final_norm(base: nn.Module) -> nn.Module | None:
    """The base model's final norm: ``norm`` (Llama style) or ``final_layernorm`` (Bamba)."""
    norm = getattr(base, "norm", None) or getattr(base, "final_layernorm", None)
    return norm if isinstance(norm, nn.Module) else None


# ------------------------------------------------------------------------------------------ stage
class HFStage(nn.Module):
    """Layers ``[start_layer, end_layer)`` of a ``transformers`` causal LM as one packed-token PP stage.

    ``layers[i]`` keeps global numbering (other stages' layers are ``PPMissingLayer`` placeholders), so
    parameter names match the HF model's. Modules are shared with ``model``, not copied. ``layer_range``
    overrides the ``get_pp_indices`` split; ``varlen=True`` serves several sequences packed into one
    forward (see the module docstring). ``compile_regions=True`` calls each decoder layer as a
    ``torch.compiler.nested_compile_region`` (whole layers, attention included: without a KV cache an HF
    layer holds nothing that differs per layer), so Dynamo traces one layer, not all of them.
    ``declare_regions=True`` declares the layers' sparse-MoE blocks of the known families
    (``TOKEN_LOCAL_BLOCKS``) token-local (``ppcompile.token_local``), so their routing stays in graphs,
    and their chunked linear-attention scans (``EAGER_CORES``) one eager break each
    (``ppcompile.eager_region``).
    """

    def __init__(
        self,
        model: nn.Module,
        pp_rank: int = 0,
        pp_size: int = 1,
        layer_range: tuple[int, int] | None = None,
        varlen: bool = False,
        compile_regions: bool = False,
        declare_regions: bool = True,
    ) -> None:
        super().__init__()
        self.compile_regions = compile_regions
        base = _decoder(model)
        num_layers = len(base.layers)
        if not 0 <= pp_rank < pp_size:
            raise ValueError(f"HFStage: pp_rank must be in [0, pp_size={pp_size}), got {pp_rank}")
        start, end = get_pp_indices(num_layers, pp_rank, pp_size) if layer_range is None else layer_range
        if not 0 <= start < end <= num_layers:
            raise ValueError(
                f"HFStage: layer_range must satisfy 0 <= start < end <= {num_layers}, got {layer_range}"
            )
        self.config = model.config
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.start_layer, self.end_layer = start, end
        self.varlen = varlen
        self.layer_types = tuple(_layer_type(self.config, i) for i in range(start, end))
        unknown = sorted(set(self.layer_types) - set(_MASK_BUILDERS))
        if unknown:
            raise ValueError(
                f"HFStage: layers {start}..{end - 1} of {type(model).__name__} use attention types "
                f"{unknown}; supported: {sorted(_MASK_BUILDERS)}"
            )
        is_first, is_last = pp_rank == 0, pp_rank == pp_size - 1
        self.embed_tokens: nn.Module | None = base.embed_tokens if is_first else None
        self.layers = nn.ModuleList(
            base.layers[i] if start <= i < end else PPMissingLayer() for i in range(num_layers)
        )
        if declare_regions:
            for i in range(start, end):
                _declare_regions(base.layers[i])
        self.rotary_emb: nn.Module = base.rotary_emb
        self.norm: nn.Module | None = _final_norm(base) if is_last else None
        head: Any = model.lm_head
        self.lm_head: nn.Module | None = head if is_last else None

    def _hidden_in(
        self, input_ids: torch.Tensor | None, proxies: Mapping[str, torch.Tensor] | None
    ) -> torch.Tensor:
        if self.embed_tokens is not None:
            if input_ids is None:
                raise ValueError(f"HFStage rank 0/{self.pp_size}: the first stage needs input_ids, got None")
            return self.embed_tokens(input_ids)
        if proxies is None or "hidden_states" not in proxies:
            have = None if proxies is None else list(proxies)
            raise ValueError(
                f"HFStage rank {self.pp_rank}/{self.pp_size}: pp_proxy_tensors must contain "
                f"'hidden_states' [T, hidden], got keys {have}"
            )
        return proxies["hidden_states"]

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        pp_proxy_tensors: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor | PPProxyTensors:
        """``input_ids``/``positions``: int64 ``[T]``; proxies: ``hidden_states [T, hidden]``."""
        hidden = self._hidden_in(input_ids, pp_proxy_tensors).unsqueeze(0)  # [1, T, H]: HF is batch-first
        # Linear-attention and Mamba layers take no positions: a stage of only those leaves them out (they
        # would be a size of their own there, tied to no token-major tensor, and break as such).
        rotary = any(kind != "linear_attention" for kind in self.layer_types)
        position_ids = positions.unsqueeze(0) if rotary or self.varlen else None
        # One sequence: no position_ids, else HF traces its packed-sequence detection (a diff and a
        # cumsum over tokens) and a materialised [T, T] mask into the graph.
        mask_positions = position_ids if self.varlen else None
        masks = {
            kind: _build_mask(kind, self.config, hidden, mask_positions)
            for kind in sorted(set(self.layer_types))
        }
        position_embeddings = self.rotary_emb(hidden, position_ids) if rotary else None
        call = _layer_region if self.compile_regions else _run_layer
        for i, kind in zip(range(self.start_layer, self.end_layer), self.layer_types):
            hidden = call(self.layers[i], hidden, masks[kind], position_ids, position_embeddings)
        if self.norm is not None and self.lm_head is not None:
            return self.lm_head(self.norm(hidden))[0]
        return PPProxyTensors({"hidden_states": hidden[0]})


def _run_layer(
    layer: nn.Module, hidden: torch.Tensor, mask: Any, position_ids: torch.Tensor | None,
    position_embeddings: Any,
) -> torch.Tensor:
    out = layer(hidden, attention_mask=mask, position_ids=position_ids,
                position_embeddings=position_embeddings)
    return out[0] if isinstance(out, tuple) else out  # older transformers return a tuple


_layer_region = nested_region(_run_layer)


def make_hf_stages(
    model: nn.Module, pp_size: int, varlen: bool = False, compile_regions: bool = False,
    declare_regions: bool = True,
) -> list[HFStage]:
    """All ``pp_size`` stages of ``model``, split by ``get_pp_indices`` (sharing ``model``'s modules)."""
    return [HFStage(model, rank, pp_size, varlen=varlen, compile_regions=compile_regions,
                    declare_regions=declare_regions)
            for rank in range(pp_size)]

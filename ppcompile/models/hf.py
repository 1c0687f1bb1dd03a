"""Hugging Face ``transformers`` causal LMs as packed-token PP stages.

``HFStage(model, pp_rank, pp_size)`` runs layers ``[start, end)`` of a decoder-only ``transformers`` model
(the dense, MoE, state-space and hybrid families of ``TINY_FAMILIES``: Llama, Gemma 2/3, Cohere, Granite,
Qwen3-MoE, DeepSeek-V3, GPT-OSS, Qwen3-Next, Mamba-2, Bamba, Falcon-H1, Zamba2, Jamba, LFM2, ...) with the
house stage contract::

    forward(input_ids [T] | None, positions [T], pp_proxy_tensors) -> PPProxyTensors | logits [T, vocab]

The first stage embeds ``input_ids`` (times the model's ``embedding_multiplier``, Granite and Falcon-H1);
later stages read the ``hidden_states`` proxy ``[T, hidden]`` (Zamba2 also ``original_hidden_states``, the
embeddings its shared attention blocks read); the last applies the final norm, ``lm_head`` and the
model's logit scaling (Cohere, Granite, Falcon-H1, Gemma's softcap). HF layers are batch-first, so the
stage runs them on ``[1, T, hidden]`` (unsqueeze at entry, squeeze at exit): proxies and logits stay
packed, token-major. Each layer gets what HF's own model passes it, by its kind (``config.layer_types``).

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
from ppcompile.tracing.regions import (
    OPAQUE_LIBRARY_MIXERS,
    class_label,
    eager_region,
    opaque_module,
    token_local,
)

try:
    from transformers import masking_utils
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "ppcompile.models.hf needs the optional dependency 'transformers': "
        "pip install 'ppcompile[hf]' (or pip install transformers)"
    ) from e

from ppcompile.models.hf_families import (
    ATTENTION_KINDS,
    EAGER_CORES,
    LAYER_MASKS,
    TINY_FAMILIES,
    TOKEN_LOCAL_BLOCKS,
    UNSUPPORTED,
    layer_kind,
    tiny_causal_lm,
    tiny_config,
)

__all__ = ["EAGER_CORES", "TINY_FAMILIES", "TOKEN_LOCAL_BLOCKS", "UNSUPPORTED", "HFStage", "make_hf_stages",
           "tiny_causal_lm", "tiny_config"]

log = logging.getLogger(__name__)


def _declare_regions(layer: nn.Module, declare: bool) -> None:
    """Makes ``layer``'s state-space mixers opaque (``ppcompile.opaque_module``; their classes are
    ``OPAQUE_LIBRARY_MIXERS``) and, with ``declare``, declares what ppcompile knows of its blocks
    (``TOKEN_LOCAL_BLOCKS``, ``EAGER_CORES``)."""
    for block in layer.modules():
        name = type(block).__name__
        if class_label(type(block)) in OPAQUE_LIBRARY_MIXERS:
            opaque_module(block)
        if not declare:
            continue
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


# ------------------------------------------------------------------------------------------ layout
def _first_attr(owner: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    found = (getattr(owner, name, None) for name in names)
    return next((m for m in found if isinstance(m, nn.Module)), None)


_EMBEDDINGS = ("embed_tokens", "embeddings")  # Mamba-2: embeddings
_FINAL_NORMS = ("norm", "final_layernorm", "norm_f", "embedding_norm")  # Bamba, Mamba-2, LFM2


def _decoder(model: nn.Module) -> Any:
    """The base decoder of a causal LM (``model.model`` for the Llama family), checked for its layout."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if not isinstance(base, nn.Module):
        raise TypeError(
            f"HFStage: {type(model).__name__} has no base model; pass a transformers *ForCausalLM model "
            "(AutoModelForCausalLM.from_config or from_pretrained)"
        )
    missing = [] if _first_attr(base, _EMBEDDINGS) is not None else ["embed_tokens"]
    missing += [] if isinstance(getattr(base, "layers", None), nn.ModuleList) else ["layers"]
    missing += [] if _first_attr(base, _FINAL_NORMS) is not None else ["norm"]
    missing += [] if hasattr(model, "lm_head") else ["lm_head"]
    if missing:
        raise TypeError(
            f"HFStage: {type(model).__name__} lacks the layout this wrapper needs (missing {missing}); "
            f"supported models keep the embeddings ({' or '.join(_EMBEDDINGS)}), layers and a final norm "
            f"({' or '.join(_FINAL_NORMS)}) on the base model and lm_head on the LM"
        )
    return base


def _logit_scales(model: nn.Module, base: nn.Module) -> tuple[tuple[str, float], ...]:
    """What the LM does to ``lm_head``'s output, in order, as HF names it: ``("mul", s)`` (Cohere's
    ``logit_scale``, Falcon-H1's ``lm_head_multiplier``), ``("div", s)`` (Granite's ``logits_scaling``),
    ``("softcap", s)`` (Gemma's ``final_logit_softcapping``)."""
    config = model.config
    found = [("mul", getattr(model, "logit_scale", None)), ("mul", getattr(base, "lm_head_multiplier", None)),
             ("div", getattr(config, "logits_scaling", None)),
             ("softcap", getattr(config, "final_logit_softcapping", None))]
    return tuple((op, float(s)) for op, s in found if isinstance(s, (int, float)))


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
    (``ppcompile.eager_region``). Mamba and Mamba-2 mixers, whose torch code fixes the token count or its
    class (``ppcompile.tracing.regions.OPAQUE_LIBRARY_MIXERS``), are made opaque custom ops
    (``ppcompile.opaque_module``), one break each, whatever ``declare_regions`` says. A family
    HFStage cannot serve (``UNSUPPORTED``, layer kinds it does not know, mixers under ``varlen=True``)
    raises a ``ValueError`` saying why.
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
        family = getattr(model.config, "model_type", "")
        if family in UNSUPPORTED:
            raise ValueError(f"HFStage: {type(model).__name__} (family {family!r}) is not supported: "
                             f"{UNSUPPORTED[family]}")
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
        self.layer_types = tuple(layer_kind(self.config, i) for i in range(start, end))
        unknown = sorted(set(self.layer_types) - set(LAYER_MASKS))
        unknown += sorted({m for k in self.layer_types for m in LAYER_MASKS.get(k, ())} - set(_MASK_BUILDERS))
        if unknown:
            raise ValueError(
                f"HFStage: layers {start}..{end - 1} of {type(model).__name__} (family {family!r}) use layer "
                f"types {unknown}; supported: {sorted(LAYER_MASKS)}"
            )
        self.mask_kinds = tuple(sorted({m for k in self.layer_types for m in LAYER_MASKS[k]}))
        if varlen and "linear_attention" in self.mask_kinds:
            raise ValueError(
                f"HFStage: varlen=True cannot serve layers {start}..{end - 1} of {type(model).__name__} "
                f"(family {family!r}, layer types {sorted(set(self.layer_types))}): their mixers carry state "
                "along the tokens, across packed sequences (HF's masks separate sequences for attention only)"
            )
        is_first, is_last = pp_rank == 0, pp_rank == pp_size - 1
        self.embed_tokens: nn.Module | None = _first_attr(base, _EMBEDDINGS) if is_first else None
        # Granite and Falcon-H1 scale the embeddings outside the embedding module (Gemma's does it inside).
        multiplier = getattr(base, "embedding_multiplier", None)
        self.embedding_multiplier = float(multiplier) if is_first and multiplier is not None else None
        self.layers = nn.ModuleList(
            base.layers[i] if start <= i < end else PPMissingLayer() for i in range(num_layers)
        )
        for i in range(start, end):
            _declare_regions(base.layers[i], declare_regions)
        # Zamba2's shared attention blocks read the embeddings in every hybrid layer: every stage but the
        # last passes them on as the ``original_hidden_states`` proxy.
        self.carries_embeddings = any(_takes(layer, "original_hidden_states") for layer in base.layers)
        self.calls = tuple(_call_style(base.layers[i]) for i in range(start, end))
        rotary = getattr(base, "rotary_emb", None)
        # Rotary embeddings when a layer of the stage reads them (Mamba and short-conv layers do not).
        uses_rotary = isinstance(rotary, nn.Module) and bool(ATTENTION_KINDS & set(self.layer_types))
        self.rotary_emb: nn.Module | None = rotary if uses_rotary else None
        # Gemma 3 computes one rotary embedding per attention type (global and local rope bases).
        self.rope_per_kind = self.rotary_emb is not None and _takes(self.rotary_emb, "layer_type")
        self.norm: nn.Module | None = _first_attr(base, _FINAL_NORMS) if is_last else None
        head: Any = model.lm_head
        self.lm_head: nn.Module | None = head if is_last else None
        self.logit_scales = _logit_scales(model, base) if is_last else ()

    def _hidden_in(
        self, input_ids: torch.Tensor | None, proxies: Mapping[str, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stage's input hidden states ``[T, hidden]`` and, for Zamba2, the embeddings."""
        if self.embed_tokens is not None:
            if input_ids is None:
                raise ValueError(f"HFStage rank 0/{self.pp_size}: the first stage needs input_ids, got None")
            hidden = self.embed_tokens(input_ids)
            if self.embedding_multiplier is not None:
                hidden = hidden * self.embedding_multiplier
            return hidden, hidden if self.carries_embeddings else None
        need = ("hidden_states", "original_hidden_states") if self.carries_embeddings else ("hidden_states",)
        if proxies is None or any(key not in proxies for key in need):
            have = None if proxies is None else list(proxies)
            raise ValueError(
                f"HFStage rank {self.pp_rank}/{self.pp_size}: pp_proxy_tensors must contain "
                + " and ".join(f"{key!r} [T, hidden]" for key in need) + f", got keys {have}"
            )
        embeddings = proxies["original_hidden_states"] if self.carries_embeddings else None
        return proxies["hidden_states"], embeddings

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        pp_proxy_tensors: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor | PPProxyTensors:
        """``input_ids``/``positions``: int64 ``[T]``; proxies: ``hidden_states [T, hidden]`` (and, for
        Zamba2, ``original_hidden_states [T, hidden]``)."""
        hidden, embeddings = self._hidden_in(input_ids, pp_proxy_tensors)
        hidden = hidden.unsqueeze(0)  # [1, T, H]: HF is batch-first
        original = embeddings.unsqueeze(0) if embeddings is not None else None
        # Layers without rotary embeddings take no positions: a stage of only those leaves them out (they
        # would be a size of their own there, tied to no token-major tensor, and break as such).
        position_ids = positions.unsqueeze(0) if self.rotary_emb is not None or self.varlen else None
        # One sequence: no position_ids, else HF traces its packed-sequence detection (a diff and a
        # cumsum over tokens) and a materialised [T, T] mask into the graph.
        mask_positions = position_ids if self.varlen else None
        masks = {kind: _build_mask(kind, self.config, hidden, mask_positions) for kind in self.mask_kinds}
        rope: dict[str, Any] = {}
        if self.rotary_emb is not None:
            if self.rope_per_kind:
                rope = {k: self.rotary_emb(hidden, position_ids, k)
                        for k in sorted(ATTENTION_KINDS & set(self.layer_types))}
            else:
                rope = dict.fromkeys(ATTENTION_KINDS, self.rotary_emb(hidden, position_ids))
        call = _layer_region if self.compile_regions else _run_layer
        for i, kind, style in zip(range(self.start_layer, self.end_layer), self.layer_types, self.calls):
            args, kwargs = _layer_inputs(i, kind, style, masks, original, position_ids, rope.get(kind))
            hidden = call(self.layers[i], hidden, args, kwargs)
        if self.norm is not None and self.lm_head is not None:
            return self._logits(self.lm_head(self.norm(hidden))[0])
        out = {"hidden_states": hidden[0]}
        if embeddings is not None:
            out["original_hidden_states"] = embeddings
        return PPProxyTensors(out)

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        for op, scale in self.logit_scales:
            if op == "mul":
                logits = logits * scale
            elif op == "div":
                logits = logits / scale
            else:  # softcap
                logits = torch.tanh(logits / scale) * scale
        return logits


# How a decoder layer takes its inputs: "zamba2" (positional: the embeddings, its layer id, the recurrent
# and the causal mask), "parallel" (Falcon-H1: the causal mask and the recurrent one as
# ``mamba_attention_mask``) or "plain" (its kind's mask); then whether it takes position_ids and
# position_embeddings by name (HF passes them to the layers that name them).
_CallStyle = tuple[str, bool, bool]


def _takes(module: nn.Module, name: str) -> bool:
    return name in inspect.signature(type(module).forward).parameters


def _call_style(layer: nn.Module) -> _CallStyle:
    style = ("zamba2" if _takes(layer, "original_hidden_states")
             else "parallel" if _takes(layer, "mamba_attention_mask") else "plain")
    return style, _takes(layer, "position_ids"), _takes(layer, "position_embeddings")


def _layer_inputs(
    index: int, kind: str, call: _CallStyle, masks: dict[str, Any], original: torch.Tensor | None,
    position_ids: torch.Tensor | None, rope: Any,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments (after the hidden states) and keywords of one layer's call, as HF's model passes them."""
    style, takes_positions, takes_rope = call
    if style == "zamba2":
        args = (original, index, masks.get("linear_attention"), masks.get("full_attention"))
        return args, {"position_embeddings": rope, "position_ids": position_ids}
    kwargs: dict[str, Any] = {"attention_mask": masks[LAYER_MASKS[kind][0]]}
    if style == "parallel":
        kwargs["mamba_attention_mask"] = masks["linear_attention"]
    if takes_positions:
        kwargs["position_ids"] = position_ids
    if takes_rope:
        kwargs["position_embeddings"] = rope
    return (), kwargs


def _run_layer(layer: nn.Module, hidden: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    out = layer(hidden, *args, **kwargs)
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

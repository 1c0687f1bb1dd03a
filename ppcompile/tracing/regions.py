"""Regions of a stage declared by the user: token-local modules and eager functions.

``ppcompile.token_local(module)``: the module is token-local as a whole (its ops stay in graphs).
``ppcompile.eager_region(function)``: every op the function traces is one eager break (its ops would
otherwise be many small breaks and graph segments: a chunked linear-attention kernel written in torch).

**Token-local modules.**

A module is *token-local* when row ``i`` of each of its outputs depends only on row ``i`` of its inputs
along the token dim, however it computes that: a sparse-MoE block routes each token by its own row, sorts
and groups tokens by expert, runs the experts and scatters the results back, and no token's output
depends on another token's. Op by op, the sort, histogram and scatter mix rows (so ``check_padding_safety``
would break at each); as a whole, the block does not. Declared, its ops stay in graphs.

The contract (the declaring user vouches for it; ppcompile cannot check it):

- **no expert capacity** (no token is dropped or re-routed because other tokens took the slots), and no
  other cross-token state (load statistics, auxiliary losses, a running counter);
- **padded rows are harmless inside**: they are routed and computed like live rows (finite: graphs read
  zeroed padding) and only their own rows receive the results, which the runtime trims.

A block that breaks the contract (capacity factors, EPLB statistics updated in forward, a kernel that
rejects some expert ids) gives live tokens other results on the graph path than eagerly at token counts
that are not a bucket.

Declaring a class covers every instance (matched by the module stack Dynamo records on each node);
declaring an instance wraps its ``forward`` so that Dynamo annotates the nodes it traces inside it.

**Eager regions.** A function declared with :func:`eager_region` is found by its frame in each node's
stack trace (nothing is wrapped or patched): every op it traces, including the functions it calls, runs
eagerly on the live rows as one break, however many of its ops could be graphed. For code that mixes
token rows all through (a chunked scan that pads the tokens to a multiple of the chunk size, folds them
into chunks and unfolds them), one break costs less than a break per row-mixing op with tiny graph
segments between.

**Opaque modules.** :func:`opaque_module` makes one module instance a single custom op that Dynamo does
not trace: one break on the live rows whose code Dynamo never sees, so nothing in it can specialise the
token count or guard on it (a scan that loops over the tokens, or pads them to a chunk with an ``if``).
:func:`opaque_library_mixers` does so for every state-space mixer of ``OPAQUE_LIBRARY_MIXERS`` in a model.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.fx.traceback
from torch import nn

__all__ = ["ANNOTATION_KEY", "LIBRARY_MODULES", "LIBRARY_MOE_BLOCKS", "LIBRARY_PREFIX", "LIBRARY_REGIONS",
           "OPAQUE_LIBRARY_MIXERS",
           "class_label", "declared_classes", "declared_functions", "eager_region", "is_declared",
           "is_library_label", "library_functions", "opaque_library_mixers", "opaque_module", "token_local",
           "undeclare"]

ANNOTATION_KEY = "pp_token_local"
"""Key of ``node.meta["custom"]`` holding the declared instance's label."""

_CLASSES: dict[type, str] = {}
_FUNCTIONS: dict[tuple[str, str], str] = {}  # (file, function name) -> label


def declared_classes() -> dict[type, str]:
    """Module classes declared token-local (class -> label); a copy."""
    return dict(_CLASSES)


def class_label(cls: type) -> str:
    """How declarations and the pass name a module class: ``module.QualName``."""
    return f"{cls.__module__}.{cls.__qualname__}"


def token_local(target: type[nn.Module] | nn.Module) -> Any:
    """Declares a module class or instance token-local as a whole (see the module docstring); returns it,
    so it also works as a class decorator. Declare before the first call of the compiled stage: Dynamo
    reads the declaration while it traces."""
    if isinstance(target, type):
        if not issubclass(target, nn.Module):
            raise TypeError(f"token_local: {target.__qualname__} is not an nn.Module subclass")
        _CLASSES[target] = class_label(target)
        return target
    if not isinstance(target, nn.Module):
        raise TypeError(f"token_local: expected an nn.Module class or instance, got {type(target).__name__}")
    if getattr(target.forward, "__pp_token_local__", None) is None:
        target.forward = _annotated(target.forward, class_label(type(target)))
    return target


def _annotated(forward: Callable[..., Any], label: str) -> Callable[..., Any]:
    @functools.wraps(forward)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.fx.traceback.annotate({ANNOTATION_KEY: label}):
            return forward(*args, **kwargs)

    wrapper.__pp_token_local__ = label  # type: ignore[attr-defined]
    return wrapper


def is_declared(module: nn.Module) -> bool:
    """Whether ``module`` (an instance) is token-local by its class or by its own declaration."""
    return type(module) in _CLASSES or getattr(module.forward, "__pp_token_local__", None) is not None


LIBRARY_REGIONS: dict[str, tuple[tuple[str, ...], str]] = {
    # Hugging Face's attention-mask builders. Given position_ids (an HF model passes them; so does a
    # wrapper written like one) they look for packed sequences (diff, cumsum) and gather the mask by
    # position, several row-mixing ops each; as one region with one label, the masks of every attention
    # type a stage builds are one break, before its first layer. Without position_ids their ops are
    # padding-safe and stay in graphs.
    "transformers.masking_utils": (
        ("create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask",
         "create_bidirectional_mask", "create_bidirectional_sliding_window_mask"),
        "library region: transformers attention masks (masking_utils)"),
}
"""Library regions, known without a declaration whenever their module is loaded: module -> (function
names, the one label of their region). Unlike a declared eager region, a library region is no break by
itself: its ops stay in graphs unless one of them must break (a padding-unsafe op), and then the whole
region is one break instead of a break per op."""
LIBRARY_PREFIX = "library region: "
OPAQUE_LIBRARY_MIXERS: frozenset[str] = frozenset(f"transformers.models.{path}" for path in (
    # Traced by Dynamo, their torch code fixes the token count or its class. Mamba's selective scan
    # (without the mamba_ssm kernels) loops over the tokens, or runs associative_scan, which specialises
    # the count; the Mamba-2 chunked scans pad to the chunk size behind ``if pad_size > 0``, so Dynamo
    # guards on the count's residue class and traces a stage graph per class.
    "mamba.modeling_mamba.MambaMixer", "falcon_mamba.modeling_falcon_mamba.FalconMambaMixer",
    "jamba.modeling_jamba.JambaMambaMixer", "zamba.modeling_zamba.ZambaMambaMixer",
    "mamba2.modeling_mamba2.Mamba2Mixer", "bamba.modeling_bamba.BambaMixer",
    "falcon_h1.modeling_falcon_h1.FalconH1Mixer", "zamba2.modeling_zamba2.Zamba2MambaMixer",
    "granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridMambaLayer",
    "nemotron_h.modeling_nemotron_h.NemotronHMamba2Mixer",
))
"""Library mixer classes (``module.QualName``) that :func:`opaque_library_mixers` makes opaque."""
LIBRARY_MOE_BLOCKS: frozenset[str] = frozenset(f"transformers.models.{path}" for path in (
    # Sparse-MoE blocks: routing sorts the tokens by expert, the expert loop reads a histogram on the host
    # and the results are scattered back by index, a break at each (three per block). Token-local as a
    # whole (``token_local``'s contract: no capacity, nothing kept across tokens), which a user may
    # declare to keep them in graphs; undeclared, each block is one library region: one break.
    "qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock", "mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock", "deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE",
    "gpt_oss.modeling_gpt_oss.GptOssMLP", "qwen3_next.modeling_qwen3_next.Qwen3NextSparseMoeBlock",
    "granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridMoE",
    "jamba.modeling_jamba.JambaSparseMoeBlock",
))
"""Library sparse-MoE block classes (``module.QualName``): library regions unless declared token-local."""
LIBRARY_MODULES: frozenset[str] = OPAQUE_LIBRARY_MIXERS | LIBRARY_MOE_BLOCKS | frozenset(
    f"transformers.models.{path}" for path in (
    # State-space and short-convolution mixers: written in torch (no mamba_ssm / causal_conv1d kernels),
    # a chunked scan pads the tokens to the chunk size, folds them into chunks, takes segment sums and
    # cumsums across them: a break per row-mixing op. As a library region each mixer is one break,
    # run eagerly on the live rows, so the states it computes never see padding. The Mamba and Mamba-2
    # mixers (``OPAQUE_LIBRARY_MIXERS``) are library regions too, and these:
    # Qwen3-Next's gated DeltaNet: transformers 5.25 splits and re-joins its tokens around the chunked
    # scan (tensor_split, cat); as one region the layer is one break in every release.
    "qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet",
    "lfm2.modeling_lfm2.Lfm2ShortConv", "lfm2_moe.modeling_lfm2_moe.Lfm2MoeShortConv",
    )
)
"""Module classes (``module.QualName``) whose instances are library regions, one per instance."""


def is_library_label(label: str) -> bool:
    """Whether a region label (``meta["pp_eager_region"]``) names a library region, not a declared one."""
    return label.startswith(LIBRARY_PREFIX)


def library_functions() -> dict[tuple[str, str], str]:
    """The functions of :data:`LIBRARY_REGIONS` whose modules are loaded (nothing is imported)."""
    found: dict[tuple[str, str], str] = {}
    for module_name, (names, label) in LIBRARY_REGIONS.items():
        module = sys.modules.get(module_name)
        for name in names if module is not None else ():
            function = getattr(module, name, None)
            code = getattr(inspect.unwrap(function), "__code__", None) if function is not None else None
            if code is not None and code.co_name == name:
                found[(code.co_filename, name)] = label
    return found


def declared_functions() -> dict[tuple[str, str], str]:
    """Functions whose ops form one region, as (source file, function name) -> label: those declared eager
    regions and the loaded :data:`LIBRARY_REGIONS` (labels :func:`is_library_label`); a copy."""
    return {**library_functions(), **_FUNCTIONS}


def _code_of(function: Callable[..., Any]) -> Any:
    inner = inspect.unwrap(function)  # decorators that keep __wrapped__
    code = getattr(inner, "__code__", None)
    if code is None:
        raise TypeError(f"eager_region: expected a Python function, got {type(function).__name__} "
                        f"{function!r} (torch ops: list them in the split_ops option)")
    return code


def eager_region(function: Callable[..., Any]) -> Callable[..., Any]:
    """Declares a Python function an eager region (see the module docstring); returns it unchanged, so it
    also works as a decorator. Declare before the first call of the compiled stage."""
    code = _code_of(function)
    _FUNCTIONS[(code.co_filename, code.co_name)] = f"{function.__module__}.{function.__qualname__}"
    return function


def undeclare(target: type[nn.Module] | nn.Module | Callable[..., Any]) -> None:
    """Takes a declaration back (tests; an engine that swaps a block's implementation)."""
    if isinstance(target, type):
        _CLASSES.pop(target, None)
    elif not isinstance(target, nn.Module):
        code = _code_of(target)
        _FUNCTIONS.pop((code.co_filename, code.co_name), None)
    elif getattr(target.forward, "__pp_token_local__", None) is not None:
        del target.forward  # the instance attribute: the class's forward shows again


# Key -> module. A key is the class and the declaration's rank in the process, not the module's id: a
# process that builds and declares its model as the last one did gets the same keys, so the compiles it
# stored (``warm_compile``; the key is a constant its guards check) apply again.
_OPAQUE: weakref.WeakValueDictionary[str, nn.Module] = weakref.WeakValueDictionary()
_DECLARED = itertools.count()


@torch.library.custom_op("ppcompile::opaque_module", mutates_args=())
def _opaque_forward(x: torch.Tensor, key: str) -> torch.Tensor:
    module = _OPAQUE.get(key)
    if module is None:
        raise RuntimeError(f"ppcompile::opaque_module: the module {key} is gone (garbage-collected)")
    out = type(module).forward(module, x)
    like = (x.shape, x.dtype, x.device)
    same = isinstance(out, torch.Tensor) and (out.shape, out.dtype, out.device) == like
    if not same:
        got = f"{out.dtype} {list(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(f"ppcompile.opaque_module: {key} must map a tensor to one of the same shape, dtype "
                        f"and device ({x.dtype} {list(x.shape)} on {x.device}), got {got}")
    return out


@_opaque_forward.register_fake
def _(x: torch.Tensor, key: str) -> torch.Tensor:
    return torch.empty_like(x)


def opaque_module(module: nn.Module) -> nn.Module:
    """Makes ``module`` (an instance) run as one opaque custom op, ``ppcompile::opaque_module``, whenever
    it is called with one tensor and every other argument its ``forward`` names ``None`` (a prefill
    stage's mixer: no cache, no mask); keywords it does not name, which its ``**kwargs`` would take, are
    dropped (HF layers pass such extras on to mixers that ignore them). Called with more, it runs as
    before (an HF model's ``generate``). The op calls the class's ``forward`` eagerly and must get back a
    tensor of the input's shape, dtype and device (checked); it has no autograd formula (a prefill
    forward). In ``pp_breakable`` it is one break on the live rows. Returns ``module``; declaring twice
    is a no-op. Declare before the first call of the compiled stage: it replaces the instance's
    ``forward``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"opaque_module: expected an nn.Module instance, got {type(module).__name__}")
    if getattr(module.forward, "__pp_opaque__", False):
        return module
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    signature = inspect.signature(type(module).forward).parameters.values()
    named = [p.name for p in signature if p.kind not in variadic][1:]  # after self
    if not named:
        raise TypeError(f"opaque_module: {class_label(type(module))}.forward takes no input")
    key = f"{class_label(type(module))}#{next(_DECLARED)}"
    _OPAQUE[key] = module
    first, others = named[0], frozenset(named[1:])

    def forward(*args: Any, **kwargs: Any) -> Any:
        x = args[0] if args else kwargs.get(first)
        rest = [*args[1:], *(v for k, v in kwargs.items() if k in others)]
        if isinstance(x, torch.Tensor) and all(v is None for v in rest):
            return _opaque_forward(x, key)
        return type(module).forward(module, *args, **kwargs)

    forward.__pp_opaque__ = True  # type: ignore[attr-defined]
    module.forward = forward
    return module


def opaque_library_mixers(model: nn.Module) -> int:
    """Makes every submodule of ``model`` whose class :data:`OPAQUE_LIBRARY_MIXERS` names opaque
    (:func:`opaque_module`); returns how many there are."""
    found = [m for m in model.modules() if class_label(type(m)) in OPAQUE_LIBRARY_MIXERS]
    for mixer in found:
        opaque_module(mixer)
    return len(found)

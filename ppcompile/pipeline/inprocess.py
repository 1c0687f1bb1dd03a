"""``InProcessPipeline``: every stage of a PP split run in one process, one after the other.

Stage ``k``'s ``pp_proxy_tensors`` go straight into stage ``k + 1``; each stage runs under a fresh forward
context holding KV caches for its own global layers only. Stage forwards are called by signature: a
forward gets ``input_ids``, ``pp_proxy_tensors`` and ``input_embeds``/``inputs_embeds`` only when it names
them (the seed engine change met stages that take embeddings and stages that take no proxies).

Outputs of a compiled stage may be views into its static buffers (valid until that stage's next call),
so the logits returned by :meth:`InProcessPipeline.forward` are valid until the next forward: clone them
to keep them.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ppcompile import torch_internals
from ppcompile.counters import counters
from ppcompile.models import (
    ModelConfig,
    get_pp_indices,
    make_forward_context,
    make_stage,
    set_forward_context,
)
from ppcompile.proxy import PPProxyTensors
from ppcompile.tracing.marks import mark_token_dynamic

__all__ = ["STAGE_RECOMPILE_LIMIT", "InProcessPipeline", "StageBinding", "StageTrace"]

_EMBED_NAMES = ("inputs_embeds", "input_embeds")
STAGE_RECOMPILE_LIMIT = 64
"""Dynamo's recompile limit wherever many stages (or compiled paths of one stage) are compiled in one
process: they share one forward code object, and Dynamo's default limit (8) is too low."""


@dataclasses.dataclass(frozen=True)
class StageBinding:
    """Which optional arguments a stage's forward accepts, read once from its signature."""

    input_ids: bool
    pp_proxy_tensors: bool
    embeds_name: str | None  # "inputs_embeds", "input_embeds" or None

    @classmethod
    def of(cls, module: nn.Module) -> StageBinding:
        """Inspects ``module.forward`` (the original module's, for a ``torch.compile`` wrapper)."""
        original = getattr(module, "_orig_mod", module)
        params = inspect.signature(original.forward).parameters
        if "positions" not in params:
            raise TypeError(
                f"{type(original).__name__}.forward{inspect.signature(original.forward)} has no "
                "'positions' parameter; a PP stage forward must take positions"
            )
        var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        return cls(
            input_ids="input_ids" in params,
            pp_proxy_tensors="pp_proxy_tensors" in params or var_kw,
            embeds_name=next((n for n in _EMBED_NAMES if n in params), None),
        )

    def kwargs(
        self,
        rank: int,
        positions: torch.Tensor,
        *,
        input_ids: torch.Tensor | None = None,
        pp_proxy_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        """The keyword arguments of one call of stage ``rank``: those its forward names.

        Dropping a non-None ``pp_proxy_tensors`` or ``inputs_embeds`` is an error (the stage would
        silently ignore them); ``input_ids`` is dropped quietly (non-first stages do not need it).
        """
        kwargs: dict[str, Any] = {"positions": positions}
        if self.input_ids:
            kwargs["input_ids"] = input_ids
        if self.pp_proxy_tensors:
            kwargs["pp_proxy_tensors"] = pp_proxy_tensors
        elif pp_proxy_tensors is not None:
            raise TypeError(f"stage {rank}'s forward takes no pp_proxy_tensors, but it was given some")
        if self.embeds_name is not None:
            kwargs[self.embeds_name] = inputs_embeds
        elif inputs_embeds is not None:
            raise TypeError(f"stage {rank}'s forward takes neither of {_EMBED_NAMES}")
        return kwargs


@dataclasses.dataclass(frozen=True)
class StageTrace:
    """How the last call of one stage was served: ``path`` is ``"graph"``, ``"eager"`` or ``"module"``
    (an uncompiled stage); ``bucket`` is the replayed bucket or None."""

    rank: int
    path: str
    bucket: int | None
    seconds: float


def _stage_options(options: Mapping[str, Any] | None, last: bool) -> dict[str, Any]:
    """``options`` for one stage of a chain: the last stage's outputs go to the caller (owned copies by
    default); the others' are consumed by the next stage before this one runs again, so views do."""
    opts = dict(options or {})
    if not last:
        opts.setdefault("owned_outputs", False)
    return opts


class InProcessPipeline:
    """The ``pp_size`` stages of ``cfg`` chained in one process, compiled with ``pp_breakable`` or eager.

    Args:
        cfg: reference model config; stages are built with :func:`make_stage` unless ``stages`` is given.
        pp_size: number of stages.
        compiled: wrap each stage in ``torch.compile(backend="pp_breakable")``.
        options: the backend's ``options`` dict (e.g. ``{"capture_sizes": [8, 16]}``); a non-last stage's
            outputs are views (``owned_outputs=False``) unless it says otherwise: the next stage reads
            them before this one runs again.
        device: where stages, inputs and KV caches live.
        dynamic: ``torch.compile``'s ``dynamic``. By default the token dims of every call's inputs are
            marked dynamic instead (``mark_token_dynamic``): one symbolic graph from the first call,
            without ``dynamic=True``'s per-call float inputs.
        stages: prebuilt stage modules to use instead of ``make_stage`` (one per rank).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        pp_size: int,
        *,
        compiled: bool,
        options: Mapping[str, Any] | None = None,
        device: torch.device | str = "cpu",
        dynamic: bool | None = None,
        stages: Sequence[nn.Module] | None = None,
    ) -> None:
        self.cfg = cfg
        self.pp_size = pp_size
        self.compiled = compiled
        self.device = torch.device(device)
        if stages is None:
            stages = [make_stage(cfg, r, pp_size, device) for r in range(pp_size)]
        self.stages: list[nn.Module] = list(stages)
        if len(self.stages) != pp_size:
            raise ValueError(f"InProcessPipeline: got {len(self.stages)} stages for pp_size={pp_size}")
        self.layer_ranges = [stage_layer_range(cfg, s, r, pp_size) for r, s in enumerate(self.stages)]
        self.bindings = [StageBinding.of(s) for s in self.stages]
        self.modules: list[nn.Module] = self.stages
        if compiled:
            torch_internals.raise_recompile_limit(STAGE_RECOMPILE_LIMIT)
            self.modules = [
                torch.compile(s, backend="pp_breakable", dynamic=dynamic,  # type: ignore[misc]
                              options=_stage_options(options, last=r == pp_size - 1))
                for r, s in enumerate(self.stages)
            ]
        self.traces: list[StageTrace | None] = [None] * pp_size

    def run_stage(
        self,
        rank: int,
        positions: torch.Tensor,
        seq_lens: Sequence[int],
        *,
        input_ids: torch.Tensor | None = None,
        pp_proxy_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> Any:
        """Runs stage ``rank`` once under a fresh forward context; returns its raw output.

        Arguments the stage's forward does not name are dropped; dropping a non-None
        ``pp_proxy_tensors`` or ``inputs_embeds`` is an error (the stage would silently ignore them).
        """
        kwargs = self.bindings[rank].kwargs(rank, positions, input_ids=input_ids,
                                            pp_proxy_tensors=pp_proxy_tensors, inputs_embeds=inputs_embeds)
        ctx = make_forward_context(seq_lens, self.cfg, self.layer_ranges[rank], device=self.device)
        out, self.traces[rank] = run_traced(self.modules[rank], kwargs, ctx, rank, self.compiled)
        return out

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        seq_lens: Sequence[int],
        *,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Runs every stage in order and returns the last stage's logits (valid until the next forward)."""
        if sum(seq_lens) != positions.shape[0]:
            raise ValueError(f"seq_lens {list(seq_lens)} sum to {sum(seq_lens)}, positions has "
                             f"{positions.shape[0]} tokens")
        out: Any = None
        for rank in range(self.pp_size):
            first = rank == 0
            out = self.run_stage(
                rank, positions, seq_lens,
                input_ids=input_ids if first else None,
                pp_proxy_tensors=None if first else _standalone(out),
                inputs_embeds=inputs_embeds if first else None,
            )
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"the last stage returned {type(out).__name__}, expected a logits tensor")
        return out

    __call__ = forward


def _standalone(proxies: Any) -> Any:
    """``proxies`` with each tensor detached from its view base (no copy).

    A compiled stage hands out views of its static buffers; Dynamo guards on a view input's base, so
    the next stage would recompile (and capture every bucket again) whenever the upstream path flips
    between graph and eager. A real PP transport delivers standalone tensors; so does this driver.
    """
    if isinstance(proxies, torch.Tensor):
        return proxies.detach()
    if isinstance(proxies, PPProxyTensors):
        return PPProxyTensors({k: v.detach() for k, v in proxies.items()})
    if isinstance(proxies, Mapping):
        return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in proxies.items()}
    return proxies


def stage_layer_range(cfg: ModelConfig, stage: nn.Module, rank: int, pp_size: int) -> range:
    """The global layers of ``stage``: its ``start_layer``/``end_layer``, else ``get_pp_indices``."""
    start, end = getattr(stage, "start_layer", None), getattr(stage, "end_layer", None)
    if start is None or end is None:
        start, end = get_pp_indices(cfg.num_layers, rank, pp_size)
    return range(int(start), int(end))


def run_traced(
    module: Any, kwargs: Mapping[str, Any], ctx: Any, rank: int, compiled: bool
) -> tuple[Any, StageTrace]:
    """``module(**kwargs)`` once under forward context ``ctx``, and how the call was served. A compiled
    stage's inputs get their token dims marked first (read when Dynamo traces; a no-op otherwise)."""
    if compiled:
        mark_token_dynamic(*kwargs.values())
    before = counters.snapshot() if compiled else None
    start = time.perf_counter()
    with set_forward_context(ctx):
        out = module(**kwargs)
    return out, trace_since(rank, before, time.perf_counter() - start)


def trace_since(rank: int, before: dict[str, Any] | None, seconds: float) -> StageTrace:
    """How a stage call was served, from the counters ``before`` it (None: an uncompiled stage)."""
    if before is None:
        return StageTrace(rank, "module", None, seconds)
    after = counters.snapshot()
    if after["replays"] > before["replays"]:
        old = before["replays_by_bucket"]
        grown = [b for b, c in after["replays_by_bucket"].items() if c > old.get(b, 0)]
        return StageTrace(rank, "graph", grown[0] if len(grown) == 1 else None, seconds)
    return StageTrace(rank, "eager", None, seconds)


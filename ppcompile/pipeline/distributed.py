"""Real pipeline parallelism: one PP stage per process, proxies exchanged over ``torch.distributed``.

Each rank builds its stage (``make_stage(cfg, rank, world_size)`` unless one is given), compiles it with
``pp_breakable`` and, per batch, receives the previous rank's proxies, runs its stage under a forward
context for its own global layers, and sends its proxies to the next rank; the last rank returns logits.
The transport is torch.distributed point-to-point (gloo on CPU, NCCL on GPU), always outside the compiled
stage, so each rank decides graph or eager on its own (token count, its cap, its padding guard).

Wire protocol: the proxies' names, dtypes and per-token row shapes (a :class:`ProxySpec`) travel once,
with the first batch; afterwards each tensor's shape follows from the batch (``sum(seq_lens)`` rows,
which every rank knows), so a batch is one message per proxy, in spec order.

Send safety: a compiled stage's outputs may be views into static buffers that its next call overwrites
(DESIGN invariant 4), and a send reads its tensor until its work completes (gloo reads it only when the
receiver posts the matching recv). ``send_mode="wait"`` therefore completes the previous batch's sends
before the stage runs again; ``send_mode="copy"`` sends owned copies instead; ``send_mode="ring"``
compiles with ``output_slots=k`` (default 2: each forward's outputs stay valid until forward i + k
starts) and keeps up to k - 1 batches of sends in flight, so the stage computes batch i + 1 while batch
i is still on the wire, with no copy (a wait on an NCCL send orders the compute stream, not the host).

Tensor parallelism inside a stage (TP x PP): :func:`init_parallel_groups` places global rank
``pp_rank * tp_size + tp_rank`` in two groups, its stage's TP group (the ranks that hold shards of one
stage and all-reduce inside it) and its PP group (the ranks with its ``tp_rank``, one per stage). A
``DistributedStage`` given both runs on its shards and exchanges proxies over its PP group: every rank
sends to its peer, the rank of the next stage with the same ``tp_rank``. A TP stage's proxies are
full-width and identical on every rank of the group (its all-reduces make them so), so each peer pair
carries one copy and no rank waits for another group's sends; the cost is ``tp_size`` copies on the wire.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ppcompile.models import ModelConfig, make_forward_context, make_stage
from ppcompile.models.tensor_parallel import NO_TP, TensorParallel
from ppcompile.pipeline.inprocess import (
    STAGE_RECOMPILE_LIMIT,
    StageBinding,
    StageTrace,
    run_traced,
    stage_layer_range,
)
from ppcompile.proxy import PPProxyTensors
from ppcompile.torch_internals import raise_recompile_limit

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "SEND_MODES",
    "DistributedStage",
    "ParallelGroups",
    "ProxyField",
    "ProxySpec",
    "default_device",
    "init_parallel_groups",
    "init_pipeline_group",
]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0
"""Process-group timeout: a recv or send that waits longer than this raises instead of hanging."""

SEND_MODES = ("wait", "copy", "ring")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool)  # wire codes: index in this tuple


# ------------------------------------------------------------------------------------------ wire format
@dataclasses.dataclass(frozen=True)
class ProxyField:
    """One proxy on the wire: its name, dtype and the shape of one token's row."""

    name: str
    dtype: torch.dtype
    row_shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ProxySpec:
    """What one stage sends the next, per token; the token count comes from the batch."""

    fields: tuple[ProxyField, ...]

    @classmethod
    def of(cls, proxies: Any, num_tokens: int, rank: int) -> ProxySpec:
        """The spec of stage ``rank``'s output; checks that every proxy is token-major."""
        if not isinstance(proxies, Mapping):
            raise TypeError(f"stage {rank} returned {type(proxies).__name__}; a non-last stage must return "
                            "a mapping of proxy tensors (PPProxyTensors or dict) for the next stage")
        fields = []
        for name, t in proxies.items():
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != num_tokens:
                got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"stage {rank}'s proxy {name!r}: expected a token-major tensor with "
                                 f"{num_tokens} rows (sum(seq_lens)), got {got}")
            if t.dtype not in _DTYPES:
                raise TypeError(f"stage {rank}'s proxy {name!r} has dtype {t.dtype}; supported: {_DTYPES}")
            fields.append(ProxyField(str(name), t.dtype, tuple(t.shape[1:])))
        if not fields:
            raise ValueError(f"stage {rank} returned no proxy tensors for the next stage")
        return cls(tuple(fields))

    def encode(self, device: torch.device) -> torch.Tensor:
        """``[count, (name_len, *name_bytes, dtype_code, ndim, *row_shape) per field]`` as int64."""
        words = [len(self.fields)]
        for f in self.fields:
            raw = f.name.encode()
            words += [len(raw), *raw, _DTYPES.index(f.dtype), len(f.row_shape), *f.row_shape]
        return torch.tensor(words, dtype=torch.int64, device=device)

    @classmethod
    def decode(cls, words: Sequence[int]) -> ProxySpec:
        """The inverse of :meth:`encode`."""
        it = iter(int(w) for w in words)
        fields = []
        for _ in range(next(it)):
            name = bytes(next(it) for _ in range(next(it))).decode()
            dtype = _DTYPES[next(it)]
            row_shape = tuple(next(it) for _ in range(next(it)))
            fields.append(ProxyField(name, dtype, row_shape))
        return cls(tuple(fields))


# ------------------------------------------------------------------------------------------ the stage
class DistributedStage:
    """This process's stage of a pipeline over ``torch.distributed``: receive, run, send.

    Stage ``k`` is rank ``k`` of ``group``; the process group must be initialised first
    (:func:`init_pipeline_group`, torchrun, or ``spawn_ranks``).

    Args:
        cfg: reference model config; the stage is ``make_stage(cfg, rank, world_size)`` unless ``stage``
            is given. Forward contexts hold KV caches for this stage's global layers.
        group: the PP process group (default: the default group).
        compiled: wrap the stage in ``torch.compile(backend="pp_breakable")``.
        options: the backend's options for this rank (ranks may differ, e.g. in ``capture_sizes``).
        device: where the stage, inputs and KV caches live (default: :func:`default_device`).
        stage: a prebuilt stage module for this rank; its forward is bound by signature.
        dynamic: ``torch.compile``'s ``dynamic``. By default the token dims of every call's inputs are
            marked dynamic instead (``mark_token_dynamic``): one symbolic graph from the first call,
            without ``dynamic=True``'s per-call float inputs.
        send_mode: ``"wait"`` completes the previous batch's sends before the stage runs again;
            ``"copy"`` sends owned copies (the stage may overwrite its outputs at once); ``"ring"`` keeps
            ``output_slots - 1`` batches of sends in flight (``options["output_slots"]``, default 2).
        tp: this rank's place in its stage's tensor-parallel group (:func:`init_parallel_groups`); the
            stage is ``make_stage(cfg, rank, world_size, tp=tp)`` and its options' ``tp_group`` defaults
            to ``tp.group``. ``group`` must then be this rank's PP group.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        group: dist.ProcessGroup | None = None,
        compiled: bool = True,
        options: Mapping[str, Any] | None = None,
        device: torch.device | str | None = None,
        stage: nn.Module | None = None,
        dynamic: bool | None = None,
        send_mode: str = "wait",
        tp: TensorParallel = NO_TP,
    ) -> None:
        if send_mode not in SEND_MODES:
            raise ValueError(f"DistributedStage: send_mode must be one of {SEND_MODES}, got {send_mode!r}")
        options = dict(options or {})
        if tp.size > 1:
            options.setdefault("tp_group", tp.group)
        if send_mode == "ring":
            options.setdefault("output_slots", 2)
            if not isinstance(options["output_slots"], int) or options["output_slots"] < 2:
                raise ValueError("DistributedStage: send_mode='ring' needs options['output_slots'] >= 2 "
                                 f"(outputs valid for that many forwards), got {options['output_slots']!r}")
        if not dist.is_initialized():
            raise RuntimeError("DistributedStage: torch.distributed is not initialised; call "
                               "init_pipeline_group() (or run under torchrun / spawn_ranks) first")
        self.cfg = cfg
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.is_first = self.rank == 0
        self.is_last = self.rank == self.world_size - 1
        self.device = torch.device(device) if device is not None else default_device(group)
        self.send_mode = send_mode
        self.tp = tp
        # Batches whose sends may still be in flight when the stage runs again.
        self.in_flight = int(options["output_slots"]) - 1 if send_mode == "ring" else 0
        self.stage = stage if stage is not None else make_stage(cfg, self.rank, self.world_size, self.device,
                                                                 tp=tp)
        self.layers = stage_layer_range(cfg, self.stage, self.rank, self.world_size)
        self.binding = StageBinding.of(self.stage)
        self.compiled = compiled
        self.module: nn.Module = self.stage
        if compiled:
            raise_recompile_limit(STAGE_RECOMPILE_LIMIT)
            self.module = torch.compile(  # type: ignore[assignment]
                self.stage, backend="pp_breakable", dynamic=dynamic, options=options
            )
        self.trace: StageTrace | None = None
        self._send_spec: ProxySpec | None = None
        self._recv_spec: ProxySpec | None = None
        # Sends in flight, one list per batch (oldest first), with the tensors they read.
        self._pending: collections.deque[list[tuple[dist.Work, torch.Tensor]]] = collections.deque()
        self.max_batches_in_flight = 0  # the most batches whose sends were in flight as the stage ran

    def forward(
        self,
        positions: torch.Tensor,
        seq_lens: Sequence[int],
        *,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """One batch through this rank: receive (non-first), run, send (non-last).

        Every rank is called with the same ``seq_lens`` and its ``positions``; ``input_ids`` and
        ``inputs_embeds`` are used by the first rank only. Returns the logits on the last rank (valid until
        its next forward, like any compiled-stage output: clone to keep) and None on the others.
        """
        num_tokens = sum(seq_lens)
        if positions.shape[0] != num_tokens:
            raise ValueError(f"DistributedStage rank {self.rank}: seq_lens {list(seq_lens)} sum to "
                             f"{num_tokens}, positions has {positions.shape[0]} tokens")
        proxies = None if self.is_first else self.recv_proxies(num_tokens)
        if self.send_mode != "copy":
            # The stage may overwrite the outputs of all but the last ``in_flight`` forwards.
            self.wait_sends(keep=self.in_flight)
        self.max_batches_in_flight = max(self.max_batches_in_flight, len(self._pending))
        out = self.run_local(
            positions, seq_lens,
            input_ids=input_ids if self.is_first else None,
            pp_proxy_tensors=proxies,
            inputs_embeds=inputs_embeds if self.is_first else None,
        )
        if self.is_last:
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"the last stage (rank {self.rank}) returned {type(out).__name__}, "
                                "expected a logits tensor")
            return out
        self.send_proxies(out, num_tokens)
        return None

    __call__ = forward

    def run_local(
        self,
        positions: torch.Tensor,
        seq_lens: Sequence[int],
        *,
        input_ids: torch.Tensor | None = None,
        pp_proxy_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> Any:
        """Runs this rank's stage once on local inputs, no communication (``forward`` uses it; so can a
        warm-up that compiles and captures every rank at once before the first batch)."""
        kwargs = self.binding.kwargs(self.rank, positions, input_ids=input_ids,
                                     pp_proxy_tensors=pp_proxy_tensors, inputs_embeds=inputs_embeds)
        ctx = make_forward_context(seq_lens, self.cfg, self.layers, device=self.device, tp_size=self.tp.size)
        out, self.trace = run_traced(self.module, kwargs, ctx, self.rank, self.compiled)
        return out

    # ---------------------------------------------------------------------------------- transport
    def send_proxies(self, proxies: Any, num_tokens: int) -> None:
        """Starts asynchronous sends of ``proxies`` to the next rank (the spec first, once)."""
        spec = ProxySpec.of(proxies, num_tokens, self.rank)
        self.wait_sends(keep=self.in_flight)  # "copy": one batch in flight; "wait": done already
        self._pending.append([])  # this batch's sends (the spec's too, with the first)
        if self._send_spec is None:
            header = spec.encode(self.device)
            self._isend(torch.tensor([header.numel()], dtype=torch.int64, device=self.device))
            self._isend(header)
            self._send_spec = spec
        elif spec != self._send_spec:
            raise ValueError(f"stage {self.rank}'s proxies changed from {self._send_spec} to {spec}; the "
                             "names, dtypes and row shapes of a stage's proxies must stay fixed")
        for f in spec.fields:
            t = proxies[f.name]
            self._isend(t.clone(memory_format=torch.contiguous_format) if self.send_mode == "copy"
                        else t.contiguous())

    def recv_proxies(self, num_tokens: int) -> PPProxyTensors:
        """Receives the previous rank's proxies for a batch of ``num_tokens`` tokens (fresh tensors)."""
        if self._recv_spec is None:
            size = torch.empty(1, dtype=torch.int64, device=self.device)
            self._recv(size)
            words = torch.empty(int(size.item()), dtype=torch.int64, device=self.device)
            self._recv(words)
            self._recv_spec = ProxySpec.decode(words.tolist())
        tensors = {
            f.name: torch.empty((num_tokens, *f.row_shape), dtype=f.dtype, device=self.device)
            for f in self._recv_spec.fields
        }
        works = [dist.irecv(t, group=self.group, group_src=self.rank - 1) for t in tensors.values()]
        for work in works:
            if work is not None:
                work.wait()
        return PPProxyTensors(tensors)

    def wait_sends(self, keep: int = 0) -> None:
        """Waits for the sends of all but the last ``keep`` batches (default: every send this rank
        started); their tensors may then change. With NCCL a wait orders the current stream after the
        send; with gloo it blocks until the send completed."""
        while len(self._pending) > keep:
            for work, _ in self._pending.popleft():
                work.wait()

    flush = wait_sends

    def _isend(self, t: torch.Tensor) -> None:
        work = dist.isend(t, group=self.group, group_dst=self.rank + 1)
        if work is not None:
            self._pending[-1].append((work, t))  # keeps t alive while the send reads it

    def _recv(self, t: torch.Tensor) -> None:
        dist.recv(t, group=self.group, group_src=self.rank - 1)

    def __enter__(self) -> DistributedStage:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.wait_sends()


# ------------------------------------------------------------------------------------------ process groups
@dataclasses.dataclass(frozen=True)
class ParallelGroups:
    """This process's place in a TP x PP job (global rank ``pp_rank * tp.size + tp.rank``)."""

    tp: TensorParallel  # its stage's TP group (NO_TP with one rank per stage)
    pp_group: dist.ProcessGroup | None  # the ranks with its tp rank, one per stage (None: the default group)
    pp_rank: int
    pp_size: int


def init_parallel_groups(tp_size: int) -> ParallelGroups:
    """Splits the default group's ranks into ``world / tp_size`` stages of ``tp_size`` consecutive ranks
    (TP inside a stage, as on one node) and creates the TP and PP groups. Every rank must call it, in the
    same order relative to other ``new_group`` calls."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1 or world % tp_size:
        raise ValueError(f"init_parallel_groups: tp_size must be a positive divisor of the world size "
                         f"({world}), got {tp_size!r}")
    pp_size = world // tp_size
    pp_rank, tp_rank = divmod(rank, tp_size)
    if tp_size == 1:
        return ParallelGroups(NO_TP, None, pp_rank, pp_size)
    tp_groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(pp_size)]
    pp_groups = [dist.new_group(list(range(t, world, tp_size))) for t in range(tp_size)]
    return ParallelGroups(TensorParallel(tp_rank, tp_size, tp_groups[pp_rank]), pp_groups[tp_rank],
                          pp_rank, pp_size)


def default_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """``cuda:<rank % device count>`` for an NCCL group (one node, one GPU per rank), else CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def init_pipeline_group(
    *,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    store: dist.Store | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> str:
    """Initialises the default process group for a pipeline; returns its backend.

    Without ``store`` the rendezvous comes from torchrun's environment (``env://``: ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, read by torch). ``backend`` defaults to NCCL when
    CUDA is available, else gloo. Every send and recv that waits longer than ``timeout_s`` raises.
    """
    if dist.is_initialized():
        raise RuntimeError("init_pipeline_group: torch.distributed is already initialised")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=-1 if rank is None else rank,
                                world_size=-1 if world_size is None else world_size, timeout=timeout)
    if backend == "nccl":
        torch.cuda.set_device(default_device())
    log.info("rank %d of %d: %s process group up (timeout %g s)", dist.get_rank(), dist.get_world_size(),
             backend, timeout_s)
    return backend

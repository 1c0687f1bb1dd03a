"""Real pipeline parallelism: one PP stage per process, proxies exchanged over ``torch.distributed``.

Each rank builds its stage (``make_stage(cfg, rank, world_size)`` unless one is given), compiles it with
``pp_breakable`` and, per micro-batch, receives the previous rank's proxies, runs its stage under a
forward context for its own global layers, and sends its proxies to the next rank; the last rank returns
logits. The transport is torch.distributed point-to-point (gloo on CPU, NCCL on GPU), always outside the
compiled stage, so each rank decides graph or eager on its own (token count, its cap, its padding guard).

Wire protocol (``wire.py``): the proxies' spec travels once, with the first micro-batch; afterwards a
micro-batch is **one message**, every proxy packed into one byte buffer (``PackedLayout``), sized by
the batch's token count, which every rank knows. The receiver unpacks it with views.

Micro-batches in flight (``depth`` d): a rank keeps up to d micro-batches' sends in flight and, in
:meth:`DistributedStage.run`, posts its receives d - 1 micro-batches ahead, so the previous rank's sends
complete while it computes. The pack is the copy that makes a send safe: the stage may overwrite its own
outputs (views into graph memory, DESIGN invariant 4) as soon as they are packed, so it never waits for a
send before it runs. A send buffer is reused only after the send that last read it completed
(``send_mode="ring"``: d buffers, micro-batch i waits for the send of i - d before packing); ``"copy"``
packs into a fresh buffer each time (the allocator's memory, bounded by the same d); ``"wait"`` orders
each forward after the previous micro-batch's send (nothing overlaps; the schedule to compare with).
With NCCL a send runs on NCCL's communication stream, ordered after the pack by NCCL's own event, and
waiting for it orders the compute stream after it: no host synchronisation. With gloo a wait blocks.

Tensor parallelism inside a stage (TP x PP, ``groups.py``): a ``DistributedStage`` given its TP group
and its PP group exchanges proxies over the PP group: every rank sends to its peer, the rank of the next
stage with the same ``tp_rank``. A TP stage's proxies are full-width and identical on every rank of the
group (its all-reduces make them so), so each peer pair carries one copy and no rank waits for another
group's sends; the cost is ``tp_size`` copies on the wire.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ppcompile.models import ModelConfig, make_forward_context, make_stage
from ppcompile.models.tensor_parallel import NO_TP, TensorParallel
from ppcompile.pipeline.groups import (
    DEFAULT_TIMEOUT_S,
    ParallelGroups,
    default_device,
    init_parallel_groups,
    init_pipeline_group,
)
from ppcompile.pipeline.inprocess import (
    STAGE_RECOMPILE_LIMIT,
    StageBinding,
    StageTrace,
    run_traced,
    stage_layer_range,
)
from ppcompile.pipeline.wire import PackedLayout, ProxyField, ProxySpec
from ppcompile.proxy import PPProxyTensors
from ppcompile.torch_internals import raise_recompile_limit

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "SEND_MODES",
    "DistributedStage",
    "MicroBatch",
    "ParallelGroups",
    "ProxyField",
    "ProxySpec",
    "default_device",
    "init_parallel_groups",
    "init_pipeline_group",
]

SEND_MODES = ("ring", "copy", "wait")


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as a rank sees it: its positions, every sequence's length, and (first rank only)
    its token ids or embeddings."""

    positions: torch.Tensor
    seq_lens: Sequence[int]
    input_ids: torch.Tensor | None = None
    inputs_embeds: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)


@dataclasses.dataclass
class _Recv:
    """A posted receive of one packed micro-batch."""

    work: Any
    buf: torch.Tensor
    num_tokens: int


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
        send_mode: ``"ring"`` (default) packs into ``depth`` reused buffers; ``"copy"`` into a fresh
            buffer per micro-batch; ``"wait"`` runs no forward while a send is in flight (module docstring).
        depth: micro-batches in flight per rank (>= 1): sends not yet complete while the stage computes,
            and, in :meth:`run`, receives posted ahead.
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
        send_mode: str = "ring",
        depth: int = 1,
        tp: TensorParallel = NO_TP,
    ) -> None:
        if send_mode not in SEND_MODES:
            raise ValueError(f"DistributedStage: send_mode must be one of {SEND_MODES}, got {send_mode!r}")
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"DistributedStage: depth must be an int >= 1 (micro-batches in flight), "
                             f"got {depth!r}")
        options = dict(options or {})
        if tp.size > 1:
            options.setdefault("tp_group", tp.group)
        if not dist.is_initialized():
            raise RuntimeError("DistributedStage: torch.distributed is not initialised; call "
                               "init_pipeline_group() (or run under torchrun / spawn_ranks) first")
        self.cfg = cfg
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.is_first = self.rank == 0
        self.is_last = self.rank == self.world_size - 1
        if not self.is_last:
            # Packed into a send buffer (or sent and waited for) before the next forward: views do.
            options.setdefault("owned_outputs", False)
        self.device = torch.device(device) if device is not None else default_device(group)
        self.send_mode = send_mode
        self.depth = depth
        self.tp = tp
        # Micro-batches whose sends may still be in flight when the next one is packed: with more than
        # depth - 1 a reused send buffer would be overwritten while a send reads it.
        self.in_flight = depth - 1
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
        self.send_layout: PackedLayout | None = None
        self.recv_layout: PackedLayout | None = None
        # Sends in flight, one list per micro-batch (oldest first), with the tensors they read.
        self._pending: collections.deque[list[tuple[dist.Work, torch.Tensor]]] = collections.deque()
        self._buffers: list[torch.Tensor | None] = [None] * depth  # "ring": packed send buffers
        self._sent = 0  # micro-batches sent
        self._recvs: collections.deque[_Recv] = collections.deque()  # receives posted ahead, oldest first
        self.max_batches_in_flight = 0  # the most micro-batches whose sends were in flight as the stage ran
        self.p2p_calls: collections.Counter[str] = collections.Counter()  # "send", "recv"; "spec": once

    # ---------------------------------------------------------------------------------- one micro-batch
    def forward(
        self,
        positions: torch.Tensor,
        seq_lens: Sequence[int],
        *,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """One micro-batch through this rank: receive (non-first), run, send (non-last).

        Every rank is called with the same ``seq_lens`` and its ``positions``; ``input_ids`` and
        ``inputs_embeds`` are used by the first rank only. Returns the logits on the last rank (valid until
        its next forward with ``owned_outputs=False``; owned by the caller by default) and None on the
        others.
        """
        return self.step(MicroBatch(positions, seq_lens, input_ids, inputs_embeds))

    __call__ = forward

    def step(self, batch: MicroBatch) -> torch.Tensor | None:
        """:meth:`forward` of a :class:`MicroBatch` (its receive is the oldest posted ahead, if any)."""
        n = batch.num_tokens
        if batch.positions.shape[0] != n:
            raise ValueError(f"DistributedStage rank {self.rank}: seq_lens {list(batch.seq_lens)} sum to "
                             f"{n}, positions has {batch.positions.shape[0]} tokens")
        proxies = None if self.is_first else self._received(n)
        if self.send_mode == "wait":
            self.wait_sends()
        self.max_batches_in_flight = max(self.max_batches_in_flight, len(self._pending))
        out = self.run_local(
            batch.positions, batch.seq_lens,
            input_ids=batch.input_ids if self.is_first else None,
            pp_proxy_tensors=proxies,
            inputs_embeds=batch.inputs_embeds if self.is_first else None,
        )
        if self.is_last:
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"the last stage (rank {self.rank}) returned {type(out).__name__}, "
                                "expected a logits tensor")
            return out
        self.send_proxies(out, n)
        return None

    def run(self, batches: Iterable[MicroBatch]) -> Iterator[torch.Tensor | None]:
        """Runs ``batches`` in order at this rank's ``depth``, yielding what :meth:`step` returns for each
        (the last rank's logits, owned by the caller unless ``owned_outputs=False``). Receives are posted
        ``depth - 1`` micro-batches ahead; the sends of the last micro-batches are waited at the end."""
        ahead: collections.deque[MicroBatch] = collections.deque()
        source = iter(batches)

        def post_ahead() -> None:
            while len(ahead) < self.depth and (batch := next(source, None)) is not None:
                if not self.is_first:
                    self.post_recv(batch.num_tokens)
                ahead.append(batch)

        post_ahead()
        while ahead:
            batch = ahead.popleft()
            out = self.step(batch)
            yield out
            post_ahead()
        self.wait_sends()

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
        warm-up that compiles and captures every rank at once before the first micro-batch)."""
        kwargs = self.binding.kwargs(self.rank, positions, input_ids=input_ids,
                                     pp_proxy_tensors=pp_proxy_tensors, inputs_embeds=inputs_embeds)
        ctx = make_forward_context(seq_lens, self.cfg, self.layers, device=self.device, tp_size=self.tp.size)
        out, self.trace = run_traced(self.module, kwargs, ctx, self.rank, self.compiled)
        return out

    # ---------------------------------------------------------------------------------- transport
    def send_proxies(self, proxies: Any, num_tokens: int) -> None:
        """Packs ``proxies`` and starts one asynchronous send to the next rank (the spec first, once)."""
        spec = ProxySpec.of(proxies, num_tokens, self.rank)
        self.wait_sends(keep=self.in_flight)  # the send that last read this micro-batch's buffer is done
        self._pending.append([])  # this micro-batch's sends (the spec's too, with the first)
        if self.send_layout is None:
            header = spec.encode(self.device)
            self._isend(torch.tensor([header.numel()], dtype=torch.int64, device=self.device), "spec")
            self._isend(header, "spec")
            self.send_layout = PackedLayout(spec)
        elif spec != self.send_layout.spec:
            raise ValueError(f"stage {self.rank}'s proxies changed from {self.send_layout.spec} to {spec}; "
                             "the names, dtypes and row shapes of a stage's proxies must stay fixed")
        buf = self._send_buffer(self.send_layout.nbytes(num_tokens))
        self._isend(self.send_layout.pack(proxies, buf, num_tokens), "send")
        self._sent += 1

    def post_recv(self, num_tokens: int) -> None:
        """Posts the receive of the next micro-batch of ``num_tokens`` tokens (the spec first, once,
        blocking); :meth:`step` waits for the oldest one posted."""
        if self.recv_layout is None:
            size = torch.empty(1, dtype=torch.int64, device=self.device)
            self._recv(size)
            words = torch.empty(int(size.item()), dtype=torch.int64, device=self.device)
            self._recv(words)
            self.recv_layout = PackedLayout(ProxySpec.decode(words.tolist()))
        buf = torch.empty(self.recv_layout.nbytes(num_tokens), dtype=torch.uint8, device=self.device)
        work = dist.irecv(buf, group=self.group, group_src=self.rank - 1)
        self.p2p_calls["recv"] += 1
        self._recvs.append(_Recv(work, buf, num_tokens))

    def recv_proxies(self, num_tokens: int) -> PPProxyTensors:
        """Receives the previous rank's proxies for ``num_tokens`` tokens (views of one fresh buffer)."""
        self.post_recv(num_tokens)
        return self._received(num_tokens)

    def wait_sends(self, keep: int = 0) -> None:
        """Waits for the sends of all but the last ``keep`` micro-batches (default: every send this rank
        started); their buffers may then change. With NCCL a wait orders the current stream after the
        send; with gloo it blocks until the send completed."""
        while len(self._pending) > keep:
            for work, _ in self._pending.popleft():
                work.wait()

    flush = wait_sends

    def _received(self, num_tokens: int) -> PPProxyTensors:
        if not self._recvs:
            self.post_recv(num_tokens)
        recv = self._recvs.popleft()
        if recv.num_tokens != num_tokens:
            raise ValueError(f"DistributedStage rank {self.rank}: the receive posted ahead was for "
                             f"{recv.num_tokens} tokens, this micro-batch has {num_tokens}")
        if recv.work is not None:
            recv.work.wait()
        assert self.recv_layout is not None
        return PPProxyTensors(self.recv_layout.views(recv.buf, num_tokens))

    def _send_buffer(self, nbytes: int) -> torch.Tensor:
        """The buffer this micro-batch is packed into: fresh (``"copy"``) or its ring slot (grown as
        needed)."""
        if self.send_mode == "copy":
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        slot = self._sent % self.depth
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf

    def _isend(self, t: torch.Tensor, kind: str) -> None:
        work = dist.isend(t, group=self.group, group_dst=self.rank + 1)
        self.p2p_calls[kind] += 1
        if work is not None:
            self._pending[-1].append((work, t))  # keeps t alive while the send reads it

    def _recv(self, t: torch.Tensor) -> None:
        dist.recv(t, group=self.group, group_src=self.rank - 1)
        self.p2p_calls["spec"] += 1

    def __enter__(self) -> DistributedStage:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.wait_sends()

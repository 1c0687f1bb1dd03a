"""Process groups of a pipeline: the default group's initialisation (torchrun or a given store) and, for
TP x PP, each rank's tensor-parallel group (its stage's ranks) and pipeline group (one rank per stage)."""

from __future__ import annotations

import dataclasses
import datetime
import logging

import torch
import torch.distributed as dist

from ppcompile.models.tensor_parallel import NO_TP, TensorParallel

__all__ = ["DEFAULT_TIMEOUT_S", "ParallelGroups", "default_device", "init_parallel_groups",
           "init_pipeline_group"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0
"""Process-group timeout: a recv or send that waits longer than this raises instead of hanging."""


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

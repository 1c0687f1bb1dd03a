"""Drivers that run the stages of a PP split: in one process (``InProcessPipeline``) or one stage per
process over ``torch.distributed`` (``DistributedStage``, launched by torchrun or ``spawn_ranks``)."""

from __future__ import annotations

from ppcompile.pipeline.distributed import (
    DistributedStage,
    ParallelGroups,
    ProxySpec,
    init_parallel_groups,
    init_pipeline_group,
)
from ppcompile.pipeline.inprocess import InProcessPipeline, StageBinding, StageTrace
from ppcompile.pipeline.launch import RankError, spawn_ranks

__all__ = [
    "DistributedStage",
    "InProcessPipeline",
    "ParallelGroups",
    "ProxySpec",
    "RankError",
    "StageBinding",
    "StageTrace",
    "init_parallel_groups",
    "init_pipeline_group",
    "spawn_ranks",
]

"""Drivers that run the stages of a PP split: in one process (``InProcessPipeline``) or one stage per
process over ``torch.distributed`` (``DistributedStage``, launched by torchrun or ``spawn_ranks``)."""

from __future__ import annotations

from ppcompile.pipeline.distributed import DistributedStage, MicroBatch
from ppcompile.pipeline.groups import ParallelGroups, init_parallel_groups, init_pipeline_group
from ppcompile.pipeline.inprocess import InProcessPipeline, StageBinding, StageTrace
from ppcompile.pipeline.launch import RankError, spawn_ranks
from ppcompile.pipeline.wire import PackedLayout, ProxySpec

__all__ = [
    "DistributedStage",
    "InProcessPipeline",
    "MicroBatch",
    "PackedLayout",
    "ParallelGroups",
    "ProxySpec",
    "RankError",
    "StageBinding",
    "StageTrace",
    "init_parallel_groups",
    "init_pipeline_group",
    "spawn_ranks",
]

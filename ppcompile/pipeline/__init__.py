"""Drivers that run the stages of a PP split: in one process (``InProcessPipeline``)."""

from __future__ import annotations

from ppcompile.pipeline.inprocess import InProcessPipeline, StageBinding, StageTrace

__all__ = ["InProcessPipeline", "StageBinding", "StageTrace"]

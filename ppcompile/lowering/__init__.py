"""Lowering: the split stage graph and the passes' facts -> one frozen ``CompiledStage``."""

from ppcompile.lowering.compiled_stage import input_specs, lower_stage
from ppcompile.lowering.program import build_program
from ppcompile.runtime.compiled_stage import CompiledStage

__all__ = ["CompiledStage", "build_program", "input_specs", "lower_stage"]

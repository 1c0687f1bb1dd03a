"""Fall-offs: why a stage graph's forwards stop reaching the graph path for a reason that is not a
documented policy (above the cap, beyond the padding guard, ``graph_mode="none"``, autograd on, lazy
capture not yet), said once.

A stage graph records each cause with what happened and the fix (``StageRuntime.fall_offs()``,
``describe()``, the report). The warning and ``counters.fall_offs`` come once per module and cause: the
stage graphs Dynamo recompiles for one module (``CompileRecord.module``) share them, so a model whose
code makes Dynamo recompile for every count class warns once, not once per recompile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ppcompile import torch_internals
from ppcompile.counters import counters
from ppcompile.runtime.compiled_stage import CompileRecord

__all__ = ["BUCKET_CAPTURE_FAILED", "CAPTURE_FAILED", "FALL_OFF_CAUSES", "NEVER_GRAPHS",
           "RECOMPILE_LIMIT", "WHOLE_CAPTURE_FAILED", "FallOffs"]

NEVER_GRAPHS = "never graphs"  # the graph's shape guards refuse every capture size
CAPTURE_FAILED = "capture failed"  # capture="all": graphs off for a module instance
BUCKET_CAPTURE_FAILED = "bucket capture failed"  # capture="lazy": that bucket runs eagerly
RECOMPILE_LIMIT = "recompile limit"  # Dynamo's next recompile of the frame runs it uncompiled
WHOLE_CAPTURE_FAILED = "whole-stage capture failed"  # that bucket's forwards take the breakable path
FALL_OFF_CAUSES = (NEVER_GRAPHS, CAPTURE_FAILED, BUCKET_CAPTURE_FAILED, RECOMPILE_LIMIT, WHOLE_CAPTURE_FAILED)

log = logging.getLogger(__name__)

# (Dynamo generation, frame, module, cause) already announced.
_ANNOUNCED: set[tuple[int, int, int, str]] = set()


class FallOffs:
    """One stage graph's fall-offs (module docstring); ``label()`` names the stage graph in warnings."""

    def __init__(self, record: CompileRecord, label: Callable[[], str]) -> None:
        frame = torch_internals.frame_id(record.compile_id)
        self._module = None if frame is None or record.module is None else (frame, record.module)
        self._label = label
        self._causes: dict[str, str] = {}  # cause -> what happened and the fix

    def note(self, cause: str, message: str) -> None:
        """Records ``cause`` (one of :data:`FALL_OFF_CAUSES`) with ``message``; warns and counts it unless
        this stage graph, or another of its module, already did."""
        if cause in self._causes:
            return
        self._causes[cause] = message
        if self._module is not None:
            key = (torch_internals.dynamo_generation(), *self._module, cause)
            if key in _ANNOUNCED:
                log.info("%s: %s (already announced for its module): %s", self._label(), cause, message)
                return
            _ANNOUNCED.add(key)
        counters.fall_offs[cause] += 1
        log.warning("%s: %s: %s", self._label(), cause, message)

    def __contains__(self, cause: str) -> bool:
        return cause in self._causes

    def as_dict(self) -> dict[str, str]:
        return dict(self._causes)

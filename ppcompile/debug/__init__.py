"""Debugging aids: pass dumps, the stage report (JSON, HTML, terminal table) and progress on long work.

See ``docs/debugging.md``. Entry points: ``options={"dump_dir": ...}`` (or ``PPCOMPILE_DUMP_DIR``),
``python -m ppcompile dump`` and ``python -m ppcompile report``.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from ppcompile.debug.capture import BucketCapture, CaptureRecord, CaptureRecorder, capture_records
from ppcompile.debug.report import build_report, load_reports, on_stage_compiled, publish_report
from ppcompile.observe.hooks import StageHooks
from ppcompile.runtime.observer import CaptureStart

if TYPE_CHECKING:
    from ppcompile.runtime.stage_runtime import StageRuntime

__all__ = [
    "DEBUG_HOOKS",
    "BucketCapture",
    "CaptureRecord",
    "build_report",
    "capture_records",
    "load_reports",
    "publish_report",
]


def _capture_recorder(runtime: StageRuntime, start: CaptureStart) -> CaptureRecorder:
    """Progress and logs for one capture run, then the stage report's rewrite (capture happens at the
    first graph-path call, after the compile-time report)."""
    held = weakref.ref(runtime)

    def rewrite_report() -> None:
        if (live := held()) is not None:
            publish_report(live)

    return CaptureRecorder(start, on_finish=rewrite_report)


# Registered by ``ppcompile/__init__.py`` (``observe/hooks.py``): dumps and the report once a stage is
# built, a recorder per capture run.
DEBUG_HOOKS = StageHooks(built=on_stage_compiled, capture=_capture_recorder)

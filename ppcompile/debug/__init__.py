"""Debugging aids: pass dumps, the stage report (JSON, HTML, terminal table) and progress on long work.

See ``docs/debugging.md``. Entry points: ``options={"dump_dir": ...}`` (or ``PPCOMPILE_DUMP_DIR``),
``python -m ppcompile dump`` and ``python -m ppcompile report``.
"""

from __future__ import annotations

from ppcompile.debug.capture import BucketCapture, CaptureRecord, capture_records
from ppcompile.debug.report import build_report, load_reports, publish_report

__all__ = [
    "BucketCapture",
    "CaptureRecord",
    "build_report",
    "capture_records",
    "load_reports",
    "publish_report",
]

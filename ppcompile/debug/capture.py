"""Capture progress and logs: the debug side of a stage's capture runs.

The backend hands ``StageRuntime`` :class:`CaptureRecorder` as its capture observer
(``runtime/observer.py``): the runtime measures each run itself and tells the recorder about each
bucket and the end through small records; the recorder logs (``DEBUG`` per bucket, ``INFO`` per
stage), drives the progress bar and calls ``on_finish`` after a successful run (the stage report's
rewrite: capture happens at the first graph-path call, after the compile-time report; the report is
rewritten once more at exit, ``debug/report.py``). The records
themselves stay with the runtime: :func:`capture_records`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ppcompile.observe.progress import Progress
from ppcompile.runtime.observer import BucketCapture, CaptureRecord, CaptureStart

if TYPE_CHECKING:
    from ppcompile.runtime.stage_runtime import StageRuntime

__all__ = ["BucketCapture", "CaptureRecord", "CaptureRecorder", "buffer_bytes", "capture_records",
           "format_bytes", "owned_buffer_bytes"]

log = logging.getLogger(__name__)


def capture_records(runtime: StageRuntime) -> list[CaptureRecord]:
    """The capture runs of ``runtime`` so far, oldest first (``StageRuntime.capture_records``)."""
    return runtime.capture_records()


class CaptureRecorder:
    """Logs and shows the progress of one capture run (see module docstring)."""

    def __init__(self, start: CaptureStart, on_finish: Callable[[], Any] | None = None) -> None:
        self._start = start
        self._on_finish = on_finish  # after a successful run: the backend wires the report rewrite
        self._progress = Progress(f"pp_breakable capture {start.stage}", start.buckets, "buckets")
        self._slowest: BucketCapture | None = None

    def bucket_done(self, bucket: BucketCapture) -> None:
        if self._slowest is None or bucket.seconds > self._slowest.seconds:
            self._slowest = bucket
        log.debug("%s: bucket %d: %d graphs in %.1f ms, outputs %s%s", self._start.stage, bucket.bucket,
                  bucket.graphs, 1e3 * bucket.seconds, format_bytes(bucket.output_bytes),
                  "" if bucket.pool_bytes is None else f", pool +{format_bytes(bucket.pool_bytes)}")
        self._progress.advance(note=f"bucket {bucket.bucket}")

    def ended(self, record: CaptureRecord) -> None:
        """Ends the progress line; after a success, logs one line for the stage and rewrites its report."""
        if record.failed is not None:
            self._progress.abort()
            return
        summary = (f"captured {record.graphs} graphs ({self._start.graphs_per_bucket} segments x "
                   f"{len(record.buckets)} buckets, {record.graph_mode}) in {record.seconds:.2f} s; graph "
                   f"outputs hold {format_bytes(record.output_bytes)}")
        if record.measured_bytes is not None:
            summary += f", CUDA pool +{format_bytes(record.measured_bytes)}"
        if self._slowest is not None:
            summary += f"; slowest bucket {self._slowest.bucket} ({1e3 * self._slowest.seconds:.1f} ms)"
        self._progress.finish(summary)
        if self._on_finish is not None:
            try:
                self._on_finish()
            except Exception:  # a report is never worth failing a forward for
                log.warning("%s: could not rewrite the stage report after capture", self._start.stage,
                            exc_info=True)


def format_bytes(n: int | float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover


def buffer_bytes(buffer: dict[str, Any]) -> str:
    """A static buffer's size as the stage report lists it (``report["static_buffers"]``), or the bridge
    whose memory it reuses."""
    owner = buffer.get("shares_memory_with")
    return format_bytes(buffer["bytes"]) if owner is None else f"in {owner}'s"


def owned_buffer_bytes(buffers: list[dict[str, Any]]) -> int:
    """Bytes the stage report's static buffers (``report["static_buffers"]``) hold, each shared bridge
    buffer once."""
    return sum(b["bytes"] for b in buffers if b.get("shares_memory_with") is None)

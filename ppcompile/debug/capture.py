"""Capture bookkeeping: time and memory per bucket, progress, and the records the reports read.

The backend hands ``StageRuntime`` this class as its capture observer (``runtime/observer.py``): the
runtime makes one :class:`CaptureRecorder` per capture run and tells it when each bucket is done; the
recorder logs (``DEBUG`` per bucket, ``INFO`` per stage), drives the progress bar, keeps a
:class:`CaptureRecord` per runtime, and calls ``on_finish`` (the stage report's rewrite: capture happens
at the first graph-path call, after the compile-time report).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ppcompile.debug.progress import Progress

if TYPE_CHECKING:
    from ppcompile.runtime.stage_runtime import StageRuntime

__all__ = ["BucketCapture", "CaptureRecord", "CaptureRecorder", "capture_records"]

log = logging.getLogger(__name__)

_RECORDS: weakref.WeakKeyDictionary[Any, list[CaptureRecord]] = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class BucketCapture:
    """One bucket's capture: its graphs, wall time, and the bytes its graph outputs hold.

    ``output_bytes`` counts the storages this bucket's graph outputs own (they live as long as the
    graphs); ``pool_bytes`` is the growth of the CUDA caching allocator's reserved memory while the
    bucket was captured (None off CUDA).
    """

    bucket: int
    graphs: int
    seconds: float
    output_bytes: int
    pool_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class CaptureRecord:
    """One capture run of a stage runtime (one per set of module-state tensors)."""

    graph_mode: str
    graphs: int
    seconds: float
    buckets: tuple[BucketCapture, ...]
    output_bytes: int
    measured_bytes: int | None  # CUDA: reserved-memory growth over the whole run
    failed: str | None = None


def capture_records(runtime: StageRuntime) -> list[CaptureRecord]:
    """The capture runs of ``runtime`` so far, oldest first."""
    return list(_RECORDS.get(runtime, ()))


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def _cuda_reserved(on_cuda: bool) -> int | None:
    return int(torch.cuda.memory_reserved()) if on_cuda else None


class CaptureRecorder:
    """Times and measures one capture run of ``runtime`` (see module docstring)."""

    def __init__(
        self, runtime: StageRuntime, graphs_per_bucket: int, held: Sequence[Any], start: float | None = None,
        buckets: int | None = None, on_finish: Callable[[StageRuntime], Any] | None = None,
    ) -> None:
        self._runtime = weakref.ref(runtime)
        self._on_finish = on_finish  # after a successful run: the backend wires the report rewrite
        self._name = runtime.name
        self._mode = runtime.graph_mode
        self._graphs_per_bucket = graphs_per_bucket
        self._on_cuda = runtime.graph_mode == "cuda" and torch.cuda.is_available()
        # Storages that are not graph outputs (static buffers, module state): never counted.
        self._seen = {_storage_key(t) for t in held if isinstance(t, torch.Tensor)}
        self._buckets: list[BucketCapture] = []
        self._start = self._last = time.perf_counter() if start is None else start
        self._reserved_start = self._reserved_last = _cuda_reserved(self._on_cuda)
        total = len(runtime.plan.sizes) if buckets is None else buckets
        self._progress = Progress(f"pp_breakable capture {self._name}", total, "buckets")

    def bucket_done(self, bucket: int, table: Sequence[Any]) -> None:
        """Records ``bucket`` as captured; ``table`` is its slot table (graph outputs filled in)."""
        now = time.perf_counter()
        new_bytes = 0
        for t in table:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                key = _storage_key(t)
                if key not in self._seen:
                    self._seen.add(key)
                    new_bytes += t.untyped_storage().nbytes()
        reserved = _cuda_reserved(self._on_cuda)
        pool = None if reserved is None or self._reserved_last is None else reserved - self._reserved_last
        record = BucketCapture(bucket, self._graphs_per_bucket, now - self._last, new_bytes, pool)
        self._buckets.append(record)
        self._last, self._reserved_last = now, reserved
        log.debug("%s: bucket %d: %d graphs in %.1f ms, outputs %s%s", self._name, bucket,
                  record.graphs, 1e3 * record.seconds, format_bytes(new_bytes),
                  "" if pool is None else f", pool +{format_bytes(pool)}")
        self._progress.advance(note=f"bucket {bucket}")

    def _record(self, failed: str | None) -> CaptureRecord:
        end = _cuda_reserved(self._on_cuda)
        measured = None if end is None or self._reserved_start is None else end - self._reserved_start
        record = CaptureRecord(
            graph_mode=self._mode,
            graphs=sum(b.graphs for b in self._buckets),
            seconds=time.perf_counter() - self._start,
            buckets=tuple(self._buckets),
            output_bytes=sum(b.output_bytes for b in self._buckets),
            measured_bytes=measured,
            failed=failed,
        )
        runtime = self._runtime()
        if runtime is not None:
            _RECORDS.setdefault(runtime, []).append(record)
        return record

    def abort(self, error: BaseException) -> None:
        """The run failed: ends the progress line and records the failure."""
        self._progress.abort()
        self._record(f"{type(error).__name__}: {error}")

    def finish(self) -> CaptureRecord:
        """The run succeeded: logs one line for the stage and rewrites its report when dumping."""
        record = self._record(None)
        slowest = max(self._buckets, key=lambda b: b.seconds, default=None)
        summary = (f"captured {record.graphs} graphs ({self._graphs_per_bucket} segments x "
                   f"{len(self._buckets)} buckets, {self._mode}) in {record.seconds:.2f} s; graph outputs "
                   f"hold {format_bytes(record.output_bytes)}")
        if record.measured_bytes is not None:
            summary += f", CUDA pool +{format_bytes(record.measured_bytes)}"
        if slowest is not None:
            summary += f"; slowest bucket {slowest.bucket} ({1e3 * slowest.seconds:.1f} ms)"
        self._progress.finish(summary)
        runtime = self._runtime()
        if runtime is not None and self._on_finish is not None:
            try:
                self._on_finish(runtime)
            except Exception:  # a report is never worth failing a forward for
                log.warning("%s: could not rewrite the stage report after capture", self._name, exc_info=True)
        return record


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

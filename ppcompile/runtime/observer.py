"""Capture runs: what a stage instance measures while it captures, and how it tells an observer.

A stage instance measures each capture run itself (:class:`CaptureMeter`: wall time per bucket, the
bytes its graph outputs hold, the CUDA pool's growth) and the runtime keeps the records
(``StageRuntime.capture_records()``). An observer, wired by the backend (the debug recorder: progress,
logs, the stage report's rewrite), hears about each run through small records, never the runtime::

    run = observer(CaptureStart("stage_graph_0", "cuda", graphs_per_bucket=33, buckets=7))
    run.bucket_done(BucketCapture(bucket=8192, graphs=33, seconds=0.41, output_bytes=..., ...))
    run.ended(CaptureRecord(...))  # also after a failed run: ``record.failed`` says why
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch

__all__ = ["NO_OBSERVER", "BucketCapture", "CaptureMeter", "CaptureObserver", "CaptureRecord", "CaptureRun",
           "CaptureStart"]


@dataclasses.dataclass(frozen=True)
class CaptureStart:
    """A capture run about to start: the stage, its graph mode, graphs per bucket, buckets asked for."""

    stage: str
    graph_mode: str
    graphs_per_bucket: int
    buckets: int


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
    """One capture run of a stage runtime (one per set of module-state tensors, or per lazy capture)."""

    graph_mode: str
    graphs: int
    seconds: float
    buckets: tuple[BucketCapture, ...]
    output_bytes: int
    measured_bytes: int | None  # CUDA: reserved-memory growth over the whole run
    failed: str | None = None


class CaptureRun(Protocol):
    """What an observer hears about one run of captures: each bucket as it is done, then the end."""

    def bucket_done(self, bucket: BucketCapture) -> None: ...

    def ended(self, record: CaptureRecord) -> None: ...


CaptureObserver = Callable[[CaptureStart], CaptureRun]


class _Silent:
    def bucket_done(self, bucket: BucketCapture) -> None:
        pass

    def ended(self, record: CaptureRecord) -> None:
        pass


def NO_OBSERVER(start: CaptureStart) -> CaptureRun:
    """Hears nothing."""
    return _Silent()


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


class CaptureMeter:
    """Measures one capture run: ``bucket_done`` per bucket (its slot table), then ``record``. Graph memory
    is the growth of reserved CUDA memory on ``device``, the stage's (None: the current device)."""

    def __init__(self, graph_mode: str, graphs_per_bucket: int, held: Iterable[Any], start: float,
                 device: torch.device | None = None) -> None:
        self._mode = graph_mode
        self._graphs = graphs_per_bucket
        self._on_cuda = graph_mode == "cuda" and torch.cuda.is_available()
        self._device = device if device is not None and device.type == "cuda" else None
        # Storages that are not graph outputs (static buffers, module state): never counted.
        self._seen = {_storage_key(t) for t in held if isinstance(t, torch.Tensor)}
        self._buckets: list[BucketCapture] = []
        self._start = self._last = start
        self._reserved_start = self._reserved_last = self._reserved()

    def _reserved(self) -> int | None:
        return int(torch.cuda.memory_reserved(self._device)) if self._on_cuda else None

    def bucket_done(self, bucket: int, table: Sequence[Any]) -> BucketCapture:
        """Records ``bucket`` as captured; ``table`` is its slot table (graph outputs filled in)."""
        now = time.perf_counter()
        new_bytes = 0
        for t in table:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                key = _storage_key(t)
                if key not in self._seen:
                    self._seen.add(key)
                    new_bytes += t.untyped_storage().nbytes()
        reserved = self._reserved()
        pool = None if reserved is None or self._reserved_last is None else reserved - self._reserved_last
        done = BucketCapture(bucket, self._graphs, now - self._last, new_bytes, pool)
        self._buckets.append(done)
        self._last, self._reserved_last = now, reserved
        return done

    def record(self, failed: BaseException | None = None) -> CaptureRecord:
        """The run so far, as a record (``failed``: the error that ended it)."""
        end = self._reserved()
        measured = None if end is None or self._reserved_start is None else end - self._reserved_start
        return CaptureRecord(
            graph_mode=self._mode,
            graphs=sum(b.graphs for b in self._buckets),
            seconds=time.perf_counter() - self._start,
            buckets=tuple(self._buckets),
            output_bytes=sum(b.output_bytes for b in self._buckets),
            measured_bytes=measured,
            failed=None if failed is None else f"{type(failed).__name__}: {failed}",
        )

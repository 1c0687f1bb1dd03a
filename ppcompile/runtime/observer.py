"""How a stage runtime tells an observer about its capture runs, without knowing who listens.

The backend passes ``StageRuntime`` a :data:`CaptureObserver` (the debug recorder: progress, time and
memory per bucket, the stage report); the runtime calls it once per capture run and reports each bucket
to the :class:`CaptureRun` it returns. Without one, nothing is recorded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

__all__ = ["NO_OBSERVER", "CaptureObserver", "CaptureRun"]


class CaptureRun(Protocol):
    """One run of captures: each bucket as it is done, then the end."""

    def bucket_done(self, bucket: int, table: Sequence[Any]) -> None: ...

    def abort(self, error: BaseException) -> None: ...

    def finish(self) -> Any: ...


CaptureObserver = Callable[[Any, int, Sequence[Any], float, int], CaptureRun]
"""``observer(runtime, graphs_per_bucket, held_tensors, start_time, buckets) -> CaptureRun``."""


class _Silent:
    def bucket_done(self, bucket: int, table: Sequence[Any]) -> None:
        pass

    def abort(self, error: BaseException) -> None:
        pass

    def finish(self) -> None:
        pass


def NO_OBSERVER(runtime: Any, graphs_per_bucket: int, held: Sequence[Any], start: float,
                buckets: int) -> CaptureRun:
    """Records nothing."""
    return _Silent()

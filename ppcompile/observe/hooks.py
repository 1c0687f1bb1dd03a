"""Hooks through which an observer above the compile side (``ppcompile.debug``) hears about stages.

The backend calls :func:`stage_built` once a stage's runtime is built, and asks
:func:`capture_observer` for the observer of each capture run; neither knows who listens. The package
``__init__`` registers the debug tools' hooks, so ``backends/`` never imports ``debug/``::

    observe_stages(StageHooks(built=on_stage_compiled, capture=capture_recorder))
    ...
    stage_built(runtime)                       # dumps, report, TORCH_TRACE
    run = capture_observer(runtime, start)     # progress bar, logs, the report's rewrite

A hook that raises is logged and skipped: observing is never worth failing a compile or a forward for.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

__all__ = ["StageHooks", "capture_observer", "observe_stages", "stage_built"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StageHooks:
    """What one observer wants to hear: ``built(runtime)`` once a stage's runtime exists, and
    ``capture(runtime, start)`` at the start of each of its capture runs, returning that run's observer
    (``runtime/observer.CaptureRun``) or None."""

    built: Callable[[Any], None] | None = None
    capture: Callable[[Any, Any], Any] | None = None


_HOOKS: list[StageHooks] = []


def observe_stages(hooks: StageHooks) -> Callable[[], None]:
    """Registers ``hooks``; returns the call that removes them again."""
    _HOOKS.append(hooks)
    return lambda: _HOOKS.remove(hooks) if hooks in _HOOKS else None


def stage_built(runtime: Any) -> None:
    """Tells every observer that ``runtime`` (a ``StageRuntime``) was built."""
    for hooks in list(_HOOKS):
        if hooks.built is not None:
            try:
                hooks.built(runtime)
            except Exception:
                log.warning("%s: an observer of built stages failed", runtime.name, exc_info=True)


def capture_observer(runtime: Any, start: Any) -> Any:
    """The observer of the capture run ``start`` (``CaptureStart``) of ``runtime``: the first that a
    registered hook returns, or None when nobody listens."""
    for hooks in list(_HOOKS):
        if hooks.capture is not None:
            try:
                run = hooks.capture(runtime, start)
            except Exception:
                log.warning("%s: an observer of capture runs failed", start.stage, exc_info=True)
                continue
            if run is not None:
                return run
    return None

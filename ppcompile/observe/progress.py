"""Progress on long work (compiling a stage, capturing its buckets).

On a terminal, a one-line bar on stderr with the count and the elapsed time, drawn only once the work has
taken longer than ``delay_s`` (short work stays silent) and at most every ``min_interval_s``. Elsewhere
(a log file, CI), one log line per finished piece of work (``INFO`` on the ``ppcompile`` logger).
``PPCOMPILE_PROGRESS``: ``auto`` (default: bar when stderr is a terminal), ``on`` or ``off``.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO

from ppcompile import envs

__all__ = ["Progress"]

log = logging.getLogger(__name__)

_BAR_WIDTH = 24


def _wants_bar(stream: TextIO) -> bool:
    mode = envs.progress()
    if mode == "off":
        return False
    if mode == "on":
        return True
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class Progress:
    """Counts ``done`` out of ``total`` units of ``label``'s work; call :meth:`finish` (or :meth:`abort`).

    ``stream`` is where the bar goes (default: ``sys.stderr`` at construction); ``clock`` is injectable
    for tests.
    """

    def __init__(
        self,
        label: str,
        total: int,
        unit: str,
        *,
        stream: TextIO | None = None,
        delay_s: float = 0.5,
        min_interval_s: float = 0.1,
        clock: Any = time.perf_counter,
    ) -> None:
        self.label = label
        self.total = total
        self.unit = unit
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        self._bar = _wants_bar(self._stream)
        self._delay_s = delay_s
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._start = clock()
        self._last_draw: float | None = None
        self._drawn_width = 0

    @property
    def elapsed_s(self) -> float:
        return float(self._clock() - self._start)

    def advance(self, n: int = 1, note: str = "") -> None:
        """Marks ``n`` more units done; redraws the bar when it is due."""
        self.done += n
        if not self._bar:
            return
        now = self._clock()
        if now - self._start < self._delay_s:
            return
        if self._last_draw is not None and now - self._last_draw < self._min_interval_s and (
            self.done < self.total
        ):
            return
        self._last_draw = now
        self._draw(note)

    def line(self, note: str = "") -> str:
        """The bar's text: ``label [#####.....] done/total unit  elapsed  note``."""
        frac = min(1.0, self.done / self.total) if self.total else 1.0
        filled = round(frac * _BAR_WIDTH)
        bar = "#" * filled + "." * (_BAR_WIDTH - filled)
        text = f"{self.label} [{bar}] {self.done}/{self.total} {self.unit} {self.elapsed_s:6.1f}s"
        return f"{text}  {note}" if note else text

    def _draw(self, note: str) -> None:
        text = self.line(note)
        pad = max(0, self._drawn_width - len(text))
        self._stream.write("\r" + text + " " * pad)
        self._stream.flush()
        self._drawn_width = len(text)

    def finish(self, summary: str) -> None:
        """Ends the work: completes the bar (if one was drawn) and logs ``summary`` once at INFO."""
        if self._last_draw is not None:
            self._draw("")
            self._stream.write("\n")
            self._stream.flush()
        log.info("%s: %s", self.label, summary)

    def abort(self) -> None:
        """Ends the bar's line after a failure (the error is reported by whoever raised it)."""
        if self._last_draw is not None:
            self._stream.write("\n")
            self._stream.flush()

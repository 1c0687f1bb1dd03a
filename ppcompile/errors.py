"""Error helpers shared by the compile side and the runtime."""

from __future__ import annotations

from typing import Any

__all__ = ["add_note", "source_line"]


def add_note(e: BaseException, note: str) -> None:
    """Adds context to an exception in flight without changing its type (a no-op before Python 3.11,
    which has no ``BaseException.add_note``)."""
    add = getattr(e, "add_note", None)
    if add is not None:
        add(note)


def source_line(node: Any) -> str:
    """The innermost user frame of an FX node's stack trace (``File "...", line N, in f``), if any."""
    trace = node.meta.get("stack_trace") or ""
    frames = [ln.strip() for ln in trace.splitlines() if ln.strip().startswith("File ")]
    return frames[-1] if frames else "(no source line recorded)"

"""Error helpers shared by the compile side and the runtime."""

from __future__ import annotations

__all__ = ["add_note"]


def add_note(e: BaseException, note: str) -> None:
    """Adds context to an exception in flight without changing its type (a no-op before Python 3.11,
    which has no ``BaseException.add_note``)."""
    add = getattr(e, "add_note", None)
    if add is not None:
        add(note)

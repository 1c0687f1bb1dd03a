"""Every environment variable ppcompile reads, in one place. All are prefixed ``PPCOMPILE_``."""

from __future__ import annotations

import os

__all__ = ["dump_dir", "log_level"]


def dump_dir() -> str | None:
    """``PPCOMPILE_DUMP_DIR``: write pass dumps here when the ``dump_dir`` option is not given."""
    return os.environ.get("PPCOMPILE_DUMP_DIR") or None


def log_level() -> str | None:
    """``PPCOMPILE_LOG_LEVEL``: level name for the ``ppcompile`` logger (``DEBUG``, ``INFO``, ...)."""
    return os.environ.get("PPCOMPILE_LOG_LEVEL") or None

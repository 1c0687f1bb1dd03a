"""Every environment variable ppcompile reads, in one place. All are prefixed ``PPCOMPILE_``."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["cache_dir", "dump_dir", "log_level", "options", "progress", "untrusted_reason"]


def cache_dir() -> str:
    """``PPCOMPILE_CACHE_DIR``: where ppcompile writes the kernel sources it generates (Triton compiles from
    source files) and warm-restart artifacts (``stages/``); default ``ppcompile-<uid>`` under the system's
    temporary directory."""
    value = os.environ.get("PPCOMPILE_CACHE_DIR")
    if value:
        return value
    user = os.getuid() if hasattr(os, "getuid") else "user"
    return os.path.join(tempfile.gettempdir(), f"ppcompile-{user}")


def untrusted_reason(path: str | os.PathLike[str]) -> str | None:
    """Why ppcompile must not run or unpickle ``path``, a file or folder under :func:`cache_dir`, or None:
    it or its parent folder belongs to another user, or another user may write it (the default cache
    dir is under the shared temp dir). Where the platform has no user ids, None."""
    if not hasattr(os, "getuid"):
        return None
    uid = os.getuid()
    for p in (Path(path), Path(path).parent):
        st = p.stat()
        if st.st_uid != uid:
            return f"{p} belongs to uid {st.st_uid}, not to this process's user ({uid})"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{p} may be written by other users (mode {stat.filemode(st.st_mode)})"
    return None


def dump_dir() -> str | None:
    """``PPCOMPILE_DUMP_DIR``: write pass dumps here when the ``dump_dir`` option is not given."""
    return os.environ.get("PPCOMPILE_DUMP_DIR") or None


def options() -> dict[str, Any]:
    """``PPCOMPILE_OPTIONS``: backend options as a JSON object (``{"graph_mode": "emulate"}``), under any
    ``options=`` a ``torch.compile`` call passes: for engines that own the ``torch.compile`` call, and
    their spawned workers, which inherit the environment. Unset or empty: none."""
    value = os.environ.get("PPCOMPILE_OPTIONS", "").strip()
    if not value:
        return {}
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"PPCOMPILE_OPTIONS: not JSON ({e}): {value!r}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"PPCOMPILE_OPTIONS: expected a JSON object of options, got {value!r}")
    return parsed


def log_level() -> str | None:
    """``PPCOMPILE_LOG_LEVEL``: level name for the ``ppcompile`` logger (``DEBUG``, ``INFO``, ...)."""
    return os.environ.get("PPCOMPILE_LOG_LEVEL") or None


def progress() -> str:
    """``PPCOMPILE_PROGRESS``: ``auto`` (default: a progress bar when stderr is a terminal, else one log
    line per stage), ``on`` (always the bar) or ``off`` (never the bar)."""
    value = (os.environ.get("PPCOMPILE_PROGRESS") or "auto").strip().lower()
    aliases = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}
    value = aliases.get(value, value)
    if value not in ("auto", "on", "off"):
        raise ValueError(f"PPCOMPILE_PROGRESS: got {value!r}; expected auto, on or off")
    return value

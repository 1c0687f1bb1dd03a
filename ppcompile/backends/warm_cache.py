"""Where warm-restart artifacts live, and what makes one stale.

One file per stage key under ``<PPCOMPILE_CACHE_DIR>/stages/``. The key hashes what a compile depends
on that no guard sees: the torch, Python and ppcompile versions, ppcompile's own source, the options,
the stage's class, the names, shapes and dtypes of its parameters and buffers, and the process's rank
in a distributed job. The model's code is checked per artifact: each records a digest of every module
Dynamo traced code from (torch's own are covered by its version), and an artifact whose module changed
is stale. Reads and writes never raise: an unreadable or stale file is a miss, and a file is replaced
whole (written aside, then renamed).

The files are pickles, and unpickling runs code: a file is read only if it and ``stages/`` belong to
this process's user and no other user may write them (the directory is made private, ``0o700``). A
file that fails this is a miss with a warning naming the fix, never loaded.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pickle
import platform
import shutil
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ppcompile import envs
from ppcompile.config import PPBreakableConfig
from ppcompile.observe.dumps import distributed_rank

__all__ = [
    "FORMAT",
    "artifact_path",
    "clear_warm_cache",
    "compile_fingerprint",
    "module_digests",
    "read_entries",
    "stage_key",
    "stale_modules",
    "warm_cache_dir",
    "write_entries",
]

log = logging.getLogger(__name__)

FORMAT = 1  # bumped when the file's layout changes


def warm_cache_dir() -> Path:
    """``<PPCOMPILE_CACHE_DIR>/stages``: the warm-restart artifacts of every stage."""
    return Path(envs.cache_dir()) / "stages"


def artifact_path(key: str) -> Path:
    """The file of the stage whose key is ``key``."""
    return warm_cache_dir() / f"{key}.bin"


def clear_warm_cache() -> int:
    """Deletes every warm-restart artifact; returns how many files there were."""
    root = warm_cache_dir()
    count = sum(1 for p in root.glob("*") if p.is_file()) if root.is_dir() else 0
    shutil.rmtree(root, ignore_errors=True)
    return count


@functools.cache
def _package_digest() -> str:
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parent.parent
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def stage_key(stage: torch.nn.Module, options: Mapping[str, Any] | None, name: str | None) -> str:
    """The cache key of ``stage`` compiled with ``options``."""
    config = PPBreakableConfig.from_options(options).as_dict()
    state = [(n, tuple(t.shape), str(t.dtype)) for n, t in (*stage.named_parameters(),
                                                            *stage.named_buffers())]
    parts = {
        "format": FORMAT, "torch": torch.__version__, "python": sys.version, "machine": platform.machine(),
        # ranks of a TP or PP group may hold stages alike in class and shapes whose compiles differ
        "ppcompile": _package_digest(), "options": config, "name": name, "rank": distributed_rank(),
        "class": f"{type(stage).__module__}.{type(stage).__qualname__}", "state": state,
    }
    text = json.dumps(parts, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def compile_fingerprint(config: PPBreakableConfig) -> str:
    """What a stage's compile with ``config`` depends on that no guard sees and an engine's cache key need
    not hold: the torch, Python and ppcompile versions, ppcompile's own source, and the options but
    ``dump_dir`` (where debug files go). A stored stage graph loads only where this is the same
    (``stored_graph``)."""
    options = {k: v for k, v in config.as_dict().items() if k != "dump_dir"}
    parts = {"format": FORMAT, "torch": torch.__version__, "python": sys.version,
             "machine": platform.machine(), "ppcompile": _package_digest(), "options": options}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()[:32]


def _module_digest(module: str) -> str | None:
    mod = sys.modules.get(module)
    path = getattr(mod, "__file__", None)
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else None
    except OSError:
        return None


def module_digests(modules: Iterable[str]) -> dict[str, str | None]:
    """A digest of each module's source file (None where it has none); torch's modules are left out."""
    return {m: _module_digest(m) for m in sorted(modules) if m.split(".")[0] != "torch"}


def stale_modules(digests: Mapping[str, str | None]) -> list[str]:
    """The modules whose source changed since ``digests`` were taken."""
    return [m for m, d in digests.items() if _module_digest(m) != d]


def read_entries(key: str) -> list[tuple[bytes, dict[str, str | None]]]:
    """The artifacts stored under ``key`` whose traced modules are unchanged, each with its digests."""
    path = artifact_path(key)
    try:
        why = envs.untrusted_reason(path)
        if why is not None:
            log.warning("warm restart: %s is not loaded, since %s; compiling afresh (make the directory "
                        "private to this user, `chmod -R go-w`, or clear it with "
                        "ppcompile.clear_warm_cache())", path, why)
            return []
        with path.open("rb") as f:
            stored = pickle.load(f)
    except FileNotFoundError:
        return []
    except Exception as e:
        log.info("warm restart: %s is unreadable (%s: %s); compiling afresh", path, type(e).__name__, e)
        return []
    if not isinstance(stored, dict) or stored.get("format") != FORMAT:
        log.info("warm restart: %s has another format; compiling afresh", path)
        return []
    fresh = []
    for data, digests in stored["entries"]:
        stale = stale_modules(digests)
        if stale:
            log.info("warm restart: an artifact in %s is stale (changed since: %s); compiling afresh",
                     path, ", ".join(stale))
            continue
        fresh.append((data, digests))
    return fresh


def write_entries(key: str, entries: list[tuple[bytes, dict[str, str | None]]]) -> Path | None:
    """Replaces ``key``'s file with ``entries``; the path, or None when it could not be written."""
    path = artifact_path(key)
    root = path.parent
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{key}.")
        with os.fdopen(fd, "wb") as f:
            pickle.dump({"format": FORMAT, "entries": entries}, f)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("warm restart: could not write %s (%s); the next start compiles afresh", path, e)
        return None
    return path

"""``ppcompile.warm_compile``: a stage whose compile a restart of the process reuses.

``torch.compile(stage, backend="pp_breakable")`` traces the stage with Dynamo in every process, and the
trace grows with the layer count. ``warm_compile`` traces it ahead of time instead (Dynamo's
``aot_compile``, whole graph) and stores the result: Dynamo's bytecode and guards, and the backend's
result (``stored_graph``): the stage graph as Dynamo handed it to the backend (``graph_codec``), and
the lowered stage when it can be stored (``stored_stage``; Inductor kernels through
``stored_kernels``). A later process with the same key (``warm_cache``) loads it, checks its guards,
and on the first call serves the lowered stage, or runs ppcompile's passes and segment compiles on the
stored graph; either way Dynamo does not trace, and capture runs as usual. A call whose guards fail
compiles and stores one more artifact, as Dynamo would recompile. A stage that cannot be traced whole
is served as ``torch.compile`` serves it, and one whose compile cannot be stored is compiled again by
each process, with one log line saying why.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ppcompile.config import is_process_group
from ppcompile.runtime.stage_runtime import StageRuntime
from ppcompile.torch_internals.precompile import (
    aot_compile,
    aot_guard_check,
    aot_traced_modules,
    dumps_aot,
    loads_aot,
)
from ppcompile.tracing.layer_stamps import is_stamped
from ppcompile.tracing.marks import tensors_in

from .pp_breakable import stored_stage_graph
from .stored_graph import StoredGraphError, StoredStageGraph, loading
from .warm_cache import artifact_path, module_digests, read_entries, stage_key, write_entries

__all__ = ["MAX_ENTRIES", "StoredGraphError", "StoredStageGraph", "WarmStage", "warm_compile"]

log = logging.getLogger(__name__)

MAX_ENTRIES = 8  # artifacts per stage (guard sets, as Dynamo's recompiles); beyond, torch.compile serves


def _backend(options: Mapping[str, Any], graphs: list[StoredStageGraph]) -> Any:
    def compile_stage(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        stored = stored_stage_graph(gm, example_inputs, options)
        if isinstance(stored, StoredStageGraph):
            graphs.append(stored)
        return stored

    return compile_stage


def _call_stage(stage: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    return stage(*args, **kwargs)


@dataclasses.dataclass
class _Artifact:
    """One stored compile: its bytes (None when it could not be stored), the digests of the modules it
    traced, and the compiled function once read back (an artifact is read when a call first needs it)."""

    data: bytes | None
    digests: dict[str, str | None]
    compiled: Any = None


class WarmStage:
    """``stage`` compiled by ``pp_breakable`` with warm restarts; call it as the stage.

    ``loaded``: artifacts read back from the cache; ``compiled``: artifacts traced in this process;
    ``path``: the cache file; ``fallback_reason``: why ``torch.compile`` serves the stage instead, or
    None."""

    def __init__(self, stage: torch.nn.Module, options: Mapping[str, Any] | None = None,
                 name: str | None = None) -> None:
        self.stage, self.options = stage, dict(options or {})
        self.key = stage_key(stage, self.options, name)
        self.path: Path = artifact_path(self.key)
        self.loaded = self.compiled = 0
        self.fallback_reason: str | None = None
        self._artifacts: list[_Artifact] | None = None  # read from the file at the first call
        self._graphs: list[StoredStageGraph] = []
        self._fallback: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._fallback is not None:
            return self._fallback(*args, **kwargs)
        if self._artifacts is None:
            self._artifacts = [_Artifact(data, digests) for data, digests in read_entries(self.key)]
        call = (self.stage, *args)
        tensors = list(tensors_in((args, kwargs)))
        for artifact in list(self._artifacts):
            compiled = artifact.compiled if artifact.compiled is not None else self._read_back(artifact)
            if compiled is None or not aot_guard_check(compiled, call, kwargs, tensors):
                continue
            try:
                return compiled(*call, **kwargs)
            except StoredGraphError as e:
                self._drop(artifact, "does not compile again", e)
        compiled = self._compile(call, kwargs)
        if compiled is None:
            return self(*args, **kwargs)  # served by torch.compile from now on
        return compiled(*call, **kwargs)

    def runtimes(self) -> list[StageRuntime]:
        """The stage runtimes built so far (an artifact builds its runtime on its first call)."""
        return [g.runtime for g in self._graphs if g.runtime is not None]

    def load_seconds(self) -> float:
        """Seconds spent reading stored stage graphs back (their first calls)."""
        return sum(g.load_seconds or 0.0 for g in self._graphs)

    def _read_back(self, artifact: _Artifact) -> Any:
        assert self._artifacts is not None and artifact.data is not None
        try:
            with loading(self.options, self._graphs):
                artifact.compiled = loads_aot(artifact.data)
        except Exception as e:
            self._drop(artifact, "does not load", e)
            return None
        self.loaded += 1
        return artifact.compiled

    def _drop(self, artifact: _Artifact, what: str, error: Exception) -> None:
        assert self._artifacts is not None
        log.warning("warm restart: a stored artifact of %s %s (%s: %s); it is dropped and the stage "
                    "compiled afresh", type(self.stage).__name__, what, type(error).__name__, error)
        self._artifacts.remove(artifact)

    def _compile(self, call: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        assert self._artifacts is not None
        if len(self._artifacts) >= MAX_ENTRIES:
            return self._fall_back(f"its guards failed for {MAX_ENTRIES} stored artifacts")
        stamped = next((name or "(the stage)" for name, m in self.stage.named_modules() if is_stamped(m)),
                       None)
        if stamped is not None:  # known before Dynamo's ahead-of-time trace, which would fail after it ran
            return self._fall_back(f"its layer {stamped} is stamped by trace_layers_once, and a stamped "
                                   "layer compiles only inside the Dynamo trace that stamps it, not from a "
                                   "stored one")
        try:
            compiled = aot_compile(_call_stage, _backend(self.options, self._graphs), call, kwargs)
        except Exception as e:
            return self._fall_back(f"Dynamo's ahead-of-time compile refused it ({type(e).__name__}: {e})")
        digests = module_digests(aot_traced_modules(compiled))
        try:
            data: bytes | None = dumps_aot(compiled)
        except Exception as e:
            data = None
            log.warning("warm restart: %s cannot be stored (%s: %s); a restart compiles it again",
                        type(self.stage).__name__, type(e).__name__, e)
        if data is not None and (held := _process_group_held(self.stage)) is not None:
            data = self._loadable(data, held)
        self._artifacts.append(_Artifact(data, digests, compiled))
        self.compiled += 1
        if data is not None:
            write_entries(self.key, [(a.data, a.digests) for a in self._artifacts if a.data is not None])
        return compiled

    def _loadable(self, data: bytes, held: str) -> bytes | None:
        """``data`` if it loads here; else None, with why. Dynamo guards a process group the traced code
        reads from a module by the object, which no other process can rebuild: checked where a stage
        holds one (a load costs as much as a restart's), rather than on every store."""
        try:
            with loading(self.options, []):
                loads_aot(data)
        except Exception as e:
            log.warning("warm restart: %s is not stored: its Dynamo guards on the process group %s holds "
                        "cannot be rebuilt in another process (%s: %s). Hold the group's name instead "
                        "(group.group_name, which functional collectives take), or run the collective as a "
                        "custom op (options collective_ops and tp_group)", type(self.stage).__name__, held,
                        type(e).__name__, e)
            return None
        return data

    def _fall_back(self, why: str) -> None:
        log.warning("warm restart: %s is compiled without warm restarts, as torch.compile compiles it: %s",
                    type(self.stage).__name__, why)
        self.fallback_reason = why
        self._fallback = torch.compile(self.stage, backend="pp_breakable", options=self.options)
        return None


def _process_group_held(stage: torch.nn.Module) -> str | None:
    """The first ``Class.attribute`` of ``stage``'s modules that holds a process group, or None."""
    for module in stage.modules():
        for name, value in vars(module).items():
            if is_process_group(value):
                return f"{type(module).__name__}.{name}"
    return None


def warm_compile(stage: torch.nn.Module, options: Mapping[str, Any] | None = None, *,
                 name: str | None = None) -> WarmStage:
    """``stage`` compiled by ``pp_breakable`` with ``options``, reusing across process starts what an
    earlier process compiled for the same stage (same code, options, torch and ppcompile). Use it where
    ``torch.compile(stage, backend="pp_breakable", options=options)`` would be: mark token dims as for
    that (:func:`ppcompile.mark_token_dynamic`) before the first call. ``name`` tells apart stages whose
    class, parameters and options are the same (two identical PP stages of one model may share a file).
    Artifacts live in ``$PPCOMPILE_CACHE_DIR/stages``; :func:`ppcompile.clear_warm_cache` deletes them.
    """
    return WarmStage(stage, options, name)

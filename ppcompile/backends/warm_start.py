"""``ppcompile.warm_compile``: a stage whose compile a restart of the process reuses.

``torch.compile(stage, backend="pp_breakable")`` traces the stage with Dynamo in every process, and the
trace grows with the layer count. ``warm_compile`` traces it ahead of time instead (Dynamo's
``aot_compile``, whole graph) and stores the result: Dynamo's bytecode and guards, the stage graph as
Dynamo handed it to the backend (``graph_codec``), and the lowered stage when it can be stored
(``stored_stage``; Inductor kernels through ``stored_kernels``). A later process with the same key
(``warm_cache``) loads it, checks its guards, and on the first call serves the lowered stage, or runs
ppcompile's passes and segment compiles on the stored graph; either way Dynamo does not trace, and
capture runs as usual. A call whose guards fail compiles and stores one more artifact, as Dynamo would
recompile. A stage that cannot be traced whole, or whose graph cannot be stored, is served as
``torch.compile`` serves it, with one log line saying why.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import pickle
import time
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ppcompile.config import PPBreakableConfig, is_process_group
from ppcompile.dynamic import tensors_in
from ppcompile.layer_stamps import is_stamped
from ppcompile.runtime.stage_runtime import StageRuntime
from ppcompile.torch_internals import tracing_context
from ppcompile.torch_internals.precompile import (
    SerializableCallable,
    aot_compile,
    aot_guard_check,
    aot_traced_modules,
    dumps_aot,
    loads_aot,
)

from .graph_codec import GraphCodecError, dumps_stage_graph, loads_stage_graph
from .pp_breakable import compile_stage, pp_breakable, serve_stage
from .stored_kernels import storing_kernels
from .stored_stage import StoredStageError, dumps_compiled_stage, loads_compiled_stage
from .warm_cache import artifact_path, module_digests, read_entries, stage_key, write_entries

__all__ = ["MAX_ENTRIES", "StoredGraphError", "StoredStageGraph", "WarmStage", "warm_compile"]

log = logging.getLogger(__name__)

_FORMAT = "ppcompile-stored-stage-2"
MAX_ENTRIES = 8  # artifacts per stage (guard sets, as Dynamo's recompiles); beyond, torch.compile serves
# While artifacts are read: the options their graphs compile with, and the list each read graph joins.
_LOADING: contextvars.ContextVar[tuple[Mapping[str, Any], list[StoredStageGraph]] | None] = \
    contextvars.ContextVar("ppcompile_warm_loading", default=None)


class StoredGraphError(RuntimeError):
    """A stored stage graph did not compile again (the artifact is then dropped, and the stage traced)."""


class StoredStageGraph(SerializableCallable):
    """The backend's result under ``aot_compile``: a stage runtime that serializes as the lowered stage
    (``stored_stage``) when it can be stored, and always as the Dynamo graph it was compiled from. Read
    back, it serves the lowered stage on its first call, or compiles the graph then (the call's inputs
    are what Dynamo would have passed the backend)."""

    def __init__(self, graph: bytes | None, options: Mapping[str, Any] | None,
                 runtime: StageRuntime | None, why_not_stored: str | None = None,
                 lowered: bytes | None = None) -> None:
        self.graph, self.options, self.runtime, self.why_not_stored = graph, options, runtime, why_not_stored
        self.lowered = lowered
        self.load_seconds: float | None = None

    @classmethod
    def serialize_compile_artifacts(cls, fn: StoredStageGraph) -> bytes:
        if fn.graph is None:
            raise GraphCodecError(fn.why_not_stored or "the stage graph was not kept")
        lowered = None
        if fn.runtime is not None:
            try:
                lowered = dumps_compiled_stage(fn.runtime.compiled)
            except StoredStageError as e:
                log.info("warm restart: the lowered stage %s is not stored (%s); a restart runs the passes "
                         "on its stored graph", fn.runtime.name, e)
        return pickle.dumps((_FORMAT, fn.graph, lowered), protocol=pickle.HIGHEST_PROTOCOL)

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> StoredStageGraph:
        loading = _LOADING.get()
        if loading is None:
            raise RuntimeError("a ppcompile stage graph is read back by ppcompile.warm_compile only")
        fmt, graph_data, lowered = pickle.loads(data)
        if fmt != _FORMAT:
            raise GraphCodecError(f"not a stored stage graph of this ppcompile ({fmt!r})")
        options, graphs = loading
        graph = cls(graph_data, options, None, lowered=lowered)
        graphs.append(graph)
        return graph

    def __call__(self, *args: Any) -> Any:
        if self.runtime is None:
            self.runtime = self._restore(list(args))
        return self.runtime(*args)

    def _restore(self, args: list[Any]) -> StageRuntime:
        config = PPBreakableConfig.from_options(self.options)
        start = time.perf_counter()
        if self.lowered is not None:
            try:
                stage = loads_compiled_stage(self.lowered)
            except Exception as e:  # StoredStageError, or anything else: a miss, never an error
                log.warning("warm restart: a stored lowered stage does not load (%s: %s); its stored graph "
                            "is compiled again", type(e).__name__, e)
            else:
                self.load_seconds = seconds = time.perf_counter() - start
                restored = dataclasses.replace(stage, record=dataclasses.replace(
                    stage.record, compile_times=types.MappingProxyType({"read_back": seconds})))
                return serve_stage(restored, config, args)
        assert self.graph is not None
        try:
            gm, fake_mode = loads_stage_graph(self.graph)
            self.load_seconds = time.perf_counter() - start
            with tracing_context(fake_mode):
                return serve_stage(compile_stage(gm, args, config), config, args)
        except Exception as e:
            raise StoredGraphError(f"{type(e).__name__}: {e}") from e


def _backend(options: Mapping[str, Any], graphs: list[StoredStageGraph]) -> Any:
    def compile_stage(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        try:
            graph, why = dumps_stage_graph(gm), None  # before the passes, which rewrite gm
        except GraphCodecError as e:
            graph, why = None, str(e)
        with storing_kernels():  # Inductor segments keep what a restart loads them from
            runtime = pp_breakable(gm, example_inputs, options)
        if not isinstance(runtime, StageRuntime):
            return runtime  # a function of a stage frame running uncompiled (frame_recovery.py): not stored
        stored = StoredStageGraph(graph, options, runtime, why)
        graphs.append(stored)
        return stored

    return compile_stage


def _call_stage(stage: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    return stage(*args, **kwargs)


@contextlib.contextmanager
def _loading(options: Mapping[str, Any], graphs: list[StoredStageGraph]) -> Iterator[None]:
    token = _LOADING.set((options, graphs))
    try:
        yield
    finally:
        _LOADING.reset(token)


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
            with _loading(self.options, self._graphs):
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
            with _loading(self.options, []):
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

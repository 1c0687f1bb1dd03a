"""The backend's result under Dynamo's ahead-of-time compile: a stage runtime that stores itself.

``torch.compile(...).aot_compile`` (the trace of ``warm_compile``; vLLM's default compile on torch >= 2.10)
needs the backend's result to serialize itself (torch's ``SerializableCallable``). A
:class:`StoredStageGraph` serves calls as the stage runtime it holds, and serializes as the Dynamo graph
the backend got (``graph_codec``) and, when it can be stored, the lowered stage (``stored_stage``; Inductor
kernels through ``stored_kernels``), with a fingerprint of what the compile depended on that no guard
sees (``warm_cache.compile_fingerprint``: ppcompile's source, torch, the options).

Read back (``torch.compiler.load_compiled_function``), it serves the lowered stage on its first call, or
runs the passes and segment compiles on the stored graph then, with the call's inputs as the example
inputs. Its options are ``warm_compile``'s while it reads artifacts (:func:`loading`), and otherwise
``PPCOMPILE_OPTIONS``, the only ones a process loading it on its own knows. An artifact whose
fingerprint is not this process's with those options (another ppcompile or torch, other options) is
refused as it loads, with :class:`StoredGraphError`, never served: a caller that compiles again when a
load fails (``warm_compile``, vLLM) does.

The restore itself (compile, serve) is the subclass's: ``pp_breakable.StageGraph``.
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
from typing import Any

import torch

from ppcompile.config import PPBreakableConfig
from ppcompile.runtime.compiled_stage import CompiledStage
from ppcompile.runtime.stage_runtime import StageRuntime
from ppcompile.torch_internals import tracing_context
from ppcompile.torch_internals.precompile import SerializableCallable

from .graph_codec import loads_stage_graph
from .stored_stage import StoredStageError, dumps_compiled_stage, loads_compiled_stage
from .warm_cache import compile_fingerprint

__all__ = ["StoredGraphError", "StoredStageGraph", "loading"]

log = logging.getLogger(__name__)

_FORMAT = "ppcompile-stored-stage-3"
# While warm_compile reads artifacts: the options their graphs compile with, and the list each read
# graph joins.
_LOADING: contextvars.ContextVar[tuple[Mapping[str, Any], list[StoredStageGraph]] | None] = \
    contextvars.ContextVar("ppcompile_warm_loading", default=None)


class StoredGraphError(RuntimeError):
    """A stored stage graph does not load here, or did not compile again."""


@contextlib.contextmanager
def loading(options: Mapping[str, Any], graphs: list[StoredStageGraph]) -> Iterator[None]:
    """Inside, a stage graph read back compiles with ``options`` and joins ``graphs``."""
    token = _LOADING.set((options, graphs))
    try:
        yield
    finally:
        _LOADING.reset(token)


class StoredStageGraph(SerializableCallable):
    """A stage runtime (``runtime``) that serializes as its lowered stage when that can be stored, and
    always as ``graph``, the Dynamo graph it was compiled from (None, with ``why_not_stored``, when the
    graph codec could not write it: serializing then raises). ``fingerprint``: the compile's
    (``warm_cache.compile_fingerprint``). Read back, ``runtime`` is None until the first call."""

    def __init__(self, graph: bytes | None, options: Mapping[str, Any] | None,
                 runtime: StageRuntime | None, why_not_stored: str | None = None,
                 lowered: bytes | None = None, fingerprint: str | None = None) -> None:
        self.graph, self.options, self.runtime, self.why_not_stored = graph, options, runtime, why_not_stored
        self.lowered, self.fingerprint = lowered, fingerprint
        self.load_seconds: float | None = None

    @classmethod
    def serialize_compile_artifacts(cls, fn: StoredStageGraph) -> bytes:
        if fn.graph is None or fn.fingerprint is None:
            why = fn.why_not_stored or "it was not kept"
            raise StoredGraphError(f"ppcompile cannot store this stage graph ({why}); a restart compiles it "
                                   "again")
        lowered = fn.lowered
        if fn.runtime is not None:
            try:
                lowered = dumps_compiled_stage(fn.runtime.compiled)
            except StoredStageError as e:
                log.info("warm restart: the lowered stage %s is not stored (%s); a restart runs the passes "
                         "on its stored graph", fn.runtime.name, e)
        return pickle.dumps((_FORMAT, fn.fingerprint, fn.graph, lowered), protocol=pickle.HIGHEST_PROTOCOL)

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> StoredStageGraph:
        stored = pickle.loads(data)
        fmt = stored[0] if isinstance(stored, tuple) and stored else type(stored).__name__
        if fmt != _FORMAT or len(stored) != 4:
            raise StoredGraphError(f"not a stored stage graph of this ppcompile ({fmt!r:.80})")
        _, fingerprint, graph_data, lowered = stored
        options, graphs = _LOADING.get() or (None, None)
        if fingerprint != compile_fingerprint(PPBreakableConfig.from_options(options)):
            where = "warm_compile's options" if graphs is not None else "PPCOMPILE_OPTIONS"
            raise StoredGraphError(
                "the stored stage graph was compiled by another ppcompile or torch, or with other options "
                f"than this process compiles with ({where}); it is not served")
        graph = cls(graph_data, options, None, lowered=lowered, fingerprint=fingerprint)
        if graphs is not None:
            graphs.append(graph)
        return graph

    def finalize_loading(self, *_: Any, **__: Any) -> None:
        """Nothing to finish after a load (a hook engines call once ``load_compiled_function`` returned):
        the stage is restored at its first call, whose inputs it compiles for."""

    def __call__(self, *args: Any) -> Any:
        if self.runtime is None:
            self.runtime = self._restore(list(args))
        return self.runtime(*args)

    def _compile(self, gm: torch.fx.GraphModule, args: list[Any], config: PPBreakableConfig) -> CompiledStage:
        """The stored graph through the passes and segment compiles (the subclass's backend)."""
        raise NotImplementedError

    def _serve(self, stage: CompiledStage, config: PPBreakableConfig, args: list[Any]) -> StageRuntime:
        """The runtime serving ``stage``, registered as the backend registers its own."""
        raise NotImplementedError

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
                return self._serve(restored, config, args)
        assert self.graph is not None
        try:
            gm, fake_mode = loads_stage_graph(self.graph)
            self.load_seconds = time.perf_counter() - start
            with tracing_context(fake_mode):
                return self._serve(self._compile(gm, args, config), config, args)
        except Exception as e:
            raise StoredGraphError(f"{type(e).__name__}: {e}") from e

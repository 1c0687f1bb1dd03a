"""What a ``StageRuntime`` tells about itself: summary, captures, memory, generated code, instrumentation.

These methods read the runtime's state and never serve a call; ``StageRuntime`` inherits them from
:class:`StageInspection`, so they are called on the runtime::

    print(runtime.describe())              # segments, break reasons, buckets
    runtime.captured_buckets()             # {0: (256, 128, ...)} per module instance
    with runtime.instrumented(timer):      # timer(category, fn) -> fn wrapped; bench/overhead.py
        stage(*inputs)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ppcompile.config import PPBreakableConfig
from ppcompile.runtime.codegen import LiveForward, replay_passes_args
from ppcompile.runtime.compiled_stage import CompiledStage
from ppcompile.runtime.graph_path import Wrap
from ppcompile.runtime.instance import StageInstance
from ppcompile.runtime.observer import CaptureRecord

__all__ = ["StageInspection"]


class StageInspection:
    """The inspection and instrumentation API of ``StageRuntime`` (a mixin: the runtime sets the state)."""

    compiled: CompiledStage
    _states: dict[tuple[Any, ...], StageInstance]
    _capture_runs: list[CaptureRecord]
    config: PPBreakableConfig
    _live_forward: LiveForward
    _wrap: Wrap | None

    def static_bytes(self) -> int:
        """Bytes of static memory this runtime holds over all module instances: static input buffers,
        bridges and captured graph outputs (each storage counted once). On CUDA, graph-private
        intermediates in the pool come on top (see ``torch.cuda.memory_reserved``)."""
        sizes: dict[int, int] = {}
        for state in list(self._states.values()):
            for t in state.static_tensors():
                storage = t.untyped_storage()
                sizes[storage.data_ptr()] = storage.nbytes()
        return sum(sizes.values())

    def capture_records(self) -> list[CaptureRecord]:
        """Every capture run so far (of any module instance), oldest first: time and memory per bucket
        (``observer.CaptureRecord``)."""
        return list(self._capture_runs)

    def captured_buckets(self) -> dict[int, tuple[int, ...]]:
        """Per module instance (in order of first call), the buckets captured so far."""
        return {i: state.captured_buckets for i, state in enumerate(self._states.values())}

    @contextlib.contextmanager
    def instrumented(self, wrap: Wrap) -> Iterator[None]:
        """While open, graph-path calls run with their parts wrapped by ``wrap(category, fn)``: graph
        replays as ``"graph replays"``, break segments as ``"break segments"``, copies of live inputs into
        static buffers as ``"copy-in"`` and of break outputs into bridges as ``"bridge copies"`` (for
        profilers and benchmarks: ``bench/overhead.py``, ``bench/launches.py``). Each instance binds the
        wrapped path at its first call inside a block and keeps it for later blocks with the same
        ``wrap`` (``graph_path.py``); calls outside run the plain path. Not for use while other threads
        call the stage."""
        saved, self._wrap = self._wrap, wrap
        try:
            yield
        finally:
            self._wrap = saved

    def instances(self) -> tuple[StageInstance, ...]:
        """The captured state of each module instance served so far, in order of first call (read-only:
        buckets, buffers, static tensors)."""
        return tuple(self._states.values())

    def generated_code(self) -> dict[str, str]:
        """The per-call code generated for this stage: the live path, and the graph paths built so far."""
        code = {"live": str(getattr(self._live_forward, "source", ""))}
        for state in self._states.values():
            binds, pass_args = state.executor.binds_inputs, replay_passes_args(state.executor.binds_inputs,
                                                                               self.config.debug)
            what = f"binds inputs {binds}, passes args {pass_args}" + (
                ", fused copies" if state.copiers is not None else "")
            code.setdefault(f"graph ({what})", str(getattr(state.forward.code, "source", "")))
        return code

    def describe(self) -> str:
        """A short human-readable summary: segments, breaks and their reasons, buckets."""
        c = self.compiled
        lines = [f"{c.name}: {len(c.segments)} segments, graph mode {c.graph_mode}, "
                 f"buckets {len(c.plan.sizes)} up to {c.plan.cap}"]
        if c.eager_reason:
            lines.append(f"  always eager: {c.eager_reason}")
        for seg in c.segments:
            what = "graph" if seg.is_graph else f"break  {seg.reason}"
            declared = seg.token_local_regions
            regions = f"  [token-local: {', '.join(declared)}]" if declared else ""
            lines.append(f"  {seg.name:<12} {seg.num_nodes:>4} nodes  {what}{regions}")
        return "\n".join(lines)

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
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from ppcompile.records import Segment
from ppcompile.runtime.buckets import BucketPlan
from ppcompile.runtime.codegen import CopyFunctions, GraphForward, LiveForward, copy_functions
from ppcompile.runtime.instance import StageInstance
from ppcompile.runtime.program import Program

__all__ = ["StageInspection"]


class StageInspection:
    """The inspection and instrumentation API of ``StageRuntime`` (a mixin: the runtime sets the state)."""

    name: str
    graph_mode: str
    plan: BucketPlan
    program: Program
    segments: list[Segment]
    eager_reason: str | None
    _states: dict[tuple[Any, ...], StageInstance]
    _live_forward: LiveForward
    _graph_forwards: dict[tuple[bool, bool, bool], GraphForward]
    _instrumented: dict[int, tuple[Any, ...]]
    _copies: CopyFunctions | None

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

    def captured_buckets(self) -> dict[int, tuple[int, ...]]:
        """Per module instance (in order of first call), the buckets captured so far."""
        return {i: state.captured_buckets for i, state in enumerate(self._states.values())}

    @contextlib.contextmanager
    def instrumented(self, wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
        """While open, graph-path calls run with their parts wrapped by ``wrap(category, fn)``: graph
        replays as ``"graph replays"``, break segments as ``"break segments"``, copies of live inputs into
        static buffers as ``"copy-in"`` and of break outputs into bridges as ``"bridge copies"`` (for
        profilers and benchmarks: ``bench/overhead.py``, ``bench/launches.py``). The wrapped per-call code
        is generated at the first call inside a block and kept for later blocks with the same ``wrap``;
        calls outside run the plain code. Not for use while other threads call the stage."""
        cached = self._instrumented.get(id(wrap))
        if cached is None or cached[0] is not wrap:
            program = dataclasses.replace(self.program, steps=tuple(
                st if st.segment.is_graph else dataclasses.replace(
                    st, fn=wrap("break segments", st.fn),
                    call=None if st.call is None else wrap("break segments", st.call))
                for st in self.program.steps))
            copies = {name: wrap("bridge copies" if name.startswith("bridge") else "copy-in", fn)
                      for name, fn in copy_functions().items()}
            cached = self._instrumented[id(wrap)] = (wrap, program, {}, copies)
        _, program, forwards, copies = cached
        saved = (self.program, self._graph_forwards, self._copies)
        states = list(self._states.values())
        saved_copiers = [state.copiers for state in states]
        for state in states:
            state.executor.replay = wrap("graph replays", state.executor.replay)  # type: ignore[method-assign]
            if state.copiers is not None:  # point 0 copies the inputs; the others bridges
                state.copiers = tuple(None if c is None else wrap("bridge copies" if k else "copy-in", c)
                                      for k, c in enumerate(state.copiers))
        self.program, self._graph_forwards, self._copies = program, forwards, copies
        try:
            yield
        finally:
            self.program, self._graph_forwards, self._copies = saved
            for state, copiers in zip(states, saved_copiers):
                state.executor.__dict__.pop("replay", None)
                state.copiers = copiers

    def instances(self) -> tuple[StageInstance, ...]:
        """The captured state of each module instance served so far, in order of first call (read-only:
        buckets, buffers, static tensors)."""
        return tuple(self._states.values())

    def generated_code(self) -> dict[str, str]:
        """The per-call code generated for this stage: the live path, and the graph paths built so far."""
        code = {"live": str(getattr(self._live_forward, "source", ""))}
        for (binds, pass_args, fused), fn in self._graph_forwards.items():
            what = f"binds inputs {binds}, passes args {pass_args}" + (", fused copies" if fused else "")
            code[f"graph ({what})"] = str(getattr(fn, "source", ""))
        return code

    def describe(self) -> str:
        """A short human-readable summary: segments, breaks and their reasons, buckets."""
        lines = [f"{self.name}: {len(self.segments)} segments, graph mode {self.graph_mode}, "
                 f"buckets {len(self.plan.sizes)} up to {self.plan.cap}"]
        if self.eager_reason:
            lines.append(f"  always eager: {self.eager_reason}")
        for seg in self.segments:
            what = "graph" if seg.is_graph else f"break  {seg.reason}"
            declared = seg.token_local_regions
            regions = f"  [token-local: {', '.join(declared)}]" if declared else ""
            lines.append(f"  {seg.name:<12} {seg.num_nodes:>4} nodes  {what}{regions}")
        return "\n".join(lines)

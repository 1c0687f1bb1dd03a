"""``StageInstance``: the captured state of one stage graph for one set of module-state tensors.

Graphs read parameters and buffers in place and bake constant scalars, so they belong to the module
instance they were captured with: a ``StageRuntime`` keeps one ``StageInstance`` per set of module-state
tensors. An instance owns the static input buffers and bridges (allocated at the largest bucket, in the
traced layout), the executor with its captured (segment, bucket) graphs, and a slot table per captured
bucket (what each graph reads and writes at that bucket). The runtime decides when to capture and which
bucket serves a call; the instance captures and holds.
"""

from __future__ import annotations

import threading
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import sympy
import torch

from ppcompile.counters import counters
from ppcompile.runtime.capture_diagnosis import describe_node, failing_node
from ppcompile.runtime.compiled_stage import CompiledStage
from ppcompile.runtime.executors import GraphExecutor, make_executor
from ppcompile.runtime.fused_copy import RowCopier, make_row_copier
from ppcompile.runtime.graph_path import GraphPath, RingSlots, Wrap, bind_graph_path, instrumented_path
from ppcompile.runtime.group_agreement import LOCAL, Agreement, GroupCaptureError
from ppcompile.runtime.observer import CaptureMeter, CaptureObserver, CaptureRecord, CaptureStart
from ppcompile.runtime.program import GraphStep, Ref
from ppcompile.runtime.stale_outputs import OutputTracker
from ppcompile.runtime.static_buffers import extent

__all__ = ["ConcurrentCallError", "StageInstance"]


class ConcurrentCallError(RuntimeError):
    """A compiled stage instance was entered while a call of it was still running."""


class StageInstance:
    """Static buffers and captured graphs for one set of module-state tensors (read-only to callers:
    ``captured_buckets``, ``input_buffers``, ``bridge_buffers``, ``static_tensors()``, ``failed``)."""

    def __init__(self, compiled: CompiledStage, args: Sequence[Any], env_max: dict[sympy.Symbol, int],
                 debug: bool, copy_kernel: str = "torch", runs: list[CaptureRecord] | None = None,
                 agreement: Agreement = LOCAL) -> None:
        program = compiled.program
        self._compiled = compiled
        # Strong references: the graphs read them (and bake scalars).
        self.module_state = tuple(args[i] for i in (*compiled.state_slots, *compiled.scalar_slots))
        self.executor: GraphExecutor = make_executor(compiled.graph_mode, debug, self._device(), agreement)
        # Static buffers by slot, in the plan's order (inputs, then bridges), in their traced layout; a
        # bridge that shares an earlier one's buffer is that buffer.
        owned = {s: plan.allocate(env_max) for s, plan in program.buffers.items() if plan.shares_with is None}
        self._buffers = {s: owned[s if plan.shares_with is None else plan.shares_with]
                         for s, plan in program.buffers.items()}
        # One fused copier per copy point (``Program.copy_points``), or None: per-tensor torch ops.
        self.copiers: tuple[Callable[..., None] | None, ...] | None = self._copiers(copy_kernel)
        self.tables: dict[int, list[Any]] = {}  # bucket -> slot table
        # The graph path, generated and bound once (``graph_path.py``); instrumented variants by hook.
        self._debug = debug
        self.ring = self._ring(env_max)
        self.forward: GraphPath = bind_graph_path(program, compiled.name, self.tables, self.executor.replay,
                                                  self.executor.binds_inputs, debug, self.copiers,
                                                  ring=self.ring)
        self._instrumented: dict[int, tuple[Wrap, GraphPath]] = {}
        self.failed: str | None = None  # capture="all": graphs are off for this instance
        self.failed_buckets: dict[int, str] = {}  # capture="lazy": buckets that run eagerly
        self.failed_at: int | None = None  # the bucket the last capture run failed at
        # Held for the duration of a graph-path call: a second concurrent entry raises, never waits.
        self.lock = threading.Lock()
        self.owner = 0  # thread ident of the call holding ``lock``
        self.storages: frozenset[int] | None = None  # static memory, for the aliased-input check
        self.tracker: OutputTracker | None = None  # debug: outputs handed out, expired at the next call
        # Capture runs are appended here (the runtime's list, oldest first).
        self.runs: list[CaptureRecord] = [] if runs is None else runs
        # The TP group's ranks capture alike: budget ends and failures are agreed (group_agreement.py).
        self._agreement = agreement
        # Outputs that are graph memory (graph outputs handed out as live-size views): owned copies copy them.
        self._static_outputs = frozenset(s for st in program.graph_steps for s in st.live_views)

    # ----------------------------------------------------------------------------------- a call
    def concurrent_call_error(self, stage: str) -> ConcurrentCallError:
        """The error for a call that found ``lock`` held (``stage``: the stage graph's name)."""
        if self.owner == threading.get_ident():
            how = "re-entered from the thread that is running it (a break op calling its own stage?)"
        else:
            how = f"called from thread {threading.get_ident()} while thread {self.owner} is running it"
        return ConcurrentCallError(
            f"pp_breakable: {stage} was {how}. A compiled stage instance serves one call at a time "
            "(its static buffers hold that call's data): use one compiled stage per thread, or serialize "
            "calls with a lock"
        )

    def own(self, outputs: tuple[Any, ...], copied: list[int]) -> tuple[Any, ...]:
        """``outputs`` with copies of those in this instance's static memory (graph outputs, and anything
        whose storage is static, like a break op's view of one); their indices go to ``copied``."""
        static = self.storages or frozenset()
        owned = list(outputs)
        for i, r in enumerate(self._compiled.program.outputs):
            value = owned[i]
            if isinstance(r, Ref) and r.size is None and isinstance(value, torch.Tensor) and (
                r.slot in self._static_outputs or value.untyped_storage().data_ptr() in static
            ):
                owned[i] = value.clone()
                copied.append(i)
        return tuple(owned)

    # ----------------------------------------------------------------------------------- inspection
    @property
    def input_buffers(self) -> Mapping[int, torch.Tensor]:
        """Static input buffers by input slot (at the largest bucket)."""
        return types.MappingProxyType({s: self._buffers[s] for s in self._compiled.program.input_buffers})

    @property
    def bridge_buffers(self) -> Mapping[int, torch.Tensor]:
        """Static bridges (break outputs that graphs read) by slot."""
        return types.MappingProxyType({s: self._buffers[s] for s in self._compiled.program.bridge_buffers})

    @property
    def captured_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self.tables))

    def static_tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor calls write: static inputs, bridges, captured graph outputs, the output ring."""
        yield from {id(t): t for t in self._buffers.values()}.values()  # bridges may share one
        if self.ring is not None:
            for ring_slot in self.ring.slots:
                yield from ring_slot.buffers
        module_slots = {*self._compiled.state_slots, *self._compiled.scalar_slots}
        for table in self.tables.values():
            for slot, value in enumerate(table):
                if isinstance(value, torch.Tensor) and slot not in module_slots:
                    yield value

    @property
    def copy_kernel(self) -> str:
        """How this instance's graph path copies into static buffers: ``"triton"`` (fused copiers) or
        ``"torch"``."""
        return "torch" if self.copiers is None else "triton"

    def _copiers(self, copy_kernel: str) -> tuple[RowCopier | None, ...] | None:
        """A copier per copy point when ``copy_kernel`` gives Triton ones ("auto": on CUDA), else None."""
        if copy_kernel == "torch":
            return None
        plans = self._compiled.program.buffers
        copiers = tuple(
            make_row_copier([self._buffers[s] for s in point.fused],
                            [plans[s].token_dim for s in point.fused], kernel=copy_kernel)
            if point.fused else None
            for point in self._compiled.program.copy_points)
        if not any(c is not None and c.kernel == "triton" for c in copiers):
            return None  # "auto" chose torch everywhere: the plain generated code is faster
        return copiers

    def _ring(self, env_max: dict[sympy.Symbol, int]) -> RingSlots | None:
        """The output ring's buffers (``Program.output_ring``): per slot, flat memory for each copied
        output at the largest bucket, which each call views with the output's live shape and eager's
        strides (``static_buffers.copy_out``); in the caller's inference mode like the static buffers."""
        ring = self._compiled.program.output_ring
        if ring is None:
            return None
        sizes = []
        for layout in ring.layouts:
            at = layout.at(env_max)
            assert at is not None, "an output's size names a symbol the call does not bind"
            sizes.append((extent(*at), layout.dtype, layout.device))
        return RingSlots([tuple(torch.zeros(size, dtype=dtype, device=device)
                                for size, dtype, device in sizes) for _ in range(ring.depth)])

    def instrumented(self, wrap: Wrap) -> GraphPath:
        """This instance's graph path with its parts wrapped by ``wrap`` (kept for later calls with it)."""
        cached = self._instrumented.get(id(wrap))
        if cached is None or cached[0] is not wrap:
            compiled = self._compiled
            path = instrumented_path(self.forward, compiled.program, compiled.name, wrap,
                                     self.executor.binds_inputs, self._debug)
            cached = self._instrumented[id(wrap)] = (wrap, path)
        return cached[1]

    # ----------------------------------------------------------------------------------- capture
    def _device(self) -> torch.device | None:
        """Where the stage's graphs run: its static buffers' device, else its parameters'."""
        for plan in self._compiled.program.buffers.values():
            return plan.spec.device
        return next((t.device for t in self.module_state if isinstance(t, torch.Tensor)), None)

    def capture(self, args: Sequence[Any], env: dict[sympy.Symbol, int], buckets: Sequence[int],
                observer: CaptureObserver, budget_s: float | None = None) -> CaptureRecord:
        """Captures each graph segment at each of ``buckets`` in order (all, or until ``budget_s`` is
        spent after the first), filling ``tables``; returns the run's record, and raises on the first
        failure (after appending the failed run's record to ``runs``; ``failed_at`` names its bucket,
        the buckets before it keep their graphs). ``env``: the call's symbols (the token symbol is set
        per bucket); ``observer`` hears about the run (``observer.py``)."""
        compiled = self._compiled
        graph_steps = compiled.program.graph_steps
        start = time.perf_counter()
        held = (*self._buffers.values(), *self.module_state)
        meter = CaptureMeter(compiled.graph_mode, len(graph_steps), held, start)
        run = observer(CaptureStart(compiled.name, compiled.graph_mode, len(graph_steps), len(buckets)))
        try:
            with torch.no_grad(), self.executor.capture_session():
                for b in buckets:
                    if self.tables and budget_s is not None and self._agreement.any(
                            time.perf_counter() - start > budget_s):
                        break
                    self.failed_at = b
                    self.tables[b] = self._capture_bucket(args, env, b, graph_steps)
                    self.failed_at = None
                    self.storages = None  # static memory grew: the aliased-input check recomputes it
                    run.bucket_done(meter.bucket_done(b, self.tables[b]))
        except BaseException as e:
            record = meter.record(e)
            self.runs.append(record)
            run.ended(record)
            raise
        record = meter.record()
        self.runs.append(record)
        run.ended(record)  # logs the capture time and memory; rewrites the stage report when dumping
        return record

    def _capture_bucket(self, args: Sequence[Any], env: dict[sympy.Symbol, int], b: int,
                        graph_steps: Sequence[GraphStep]) -> list[Any]:
        """Bucket ``b``'s slot table, every graph segment captured. Its own frame: once the executor
        holds the bucket's graph outputs through non-owning tensors, no local of the loop keeps one
        alive (the pool reuses their blocks for the next bucket's capture)."""
        compiled = self._compiled
        token = compiled.token_symbol
        assert token is not None
        env[token] = b
        table: list[Any] = [None] * compiled.program.num_slots
        for i in (*compiled.state_slots, *compiled.scalar_slots):
            table[i] = args[i]
        for s, buf in self._buffers.items():
            table[s] = compiled.program.buffers[s].view(buf, env, b)
        for st in graph_steps:
            sargs = [table[r.slot] if r.size is None else r.size(env) for r in st.args]
            what = f"pp_breakable: capturing segment {st.segment.name} of {compiled.name} for bucket {b}"
            try:  # the executor settles the capture with the TP group (executors.GraphExecutor)
                outs = self.executor.capture((st.index, b), st.fn, sargs, st.output_shapes(env),
                                             st.output_strides(env))
            except GroupCaptureError as e:
                raise GroupCaptureError(f"{what} failed on rank(s) {e.ranks} of its TP group, so this rank "
                                        "drops it too", e.ranks) from None
            except Exception as e:
                raise RuntimeError(f"{what} failed: {type(e).__name__}: {e}{self._where(st, sargs)}") from e
            counters.captures += 1
            for s, o in zip(st.out_slots, outs):
                if s >= 0:
                    table[s] = o
        swap = self.executor.bucket_captured(b)
        if swap:  # the table holds the bucket's graph outputs through non-owning tensors too
            table = [swap.get(id(v), v) if isinstance(v, torch.Tensor) else v for v in table]
        if not self.executor.binds_inputs:
            # Replays return fresh outputs: the capture run's are not worth keeping.
            for st in graph_steps:
                for s in st.out_slots:
                    if s >= 0:
                        table[s] = None
        return table

    def _where(self, st: GraphStep, sargs: Sequence[Any]) -> str:
        """`` (at node ...)`` naming the node of ``st``'s FX graph whose op fails under capture, if any."""
        module = getattr(self._compiled.record.split_module, st.segment.name, None)
        if not isinstance(module, torch.fx.GraphModule) or self._agreement.size > 1:
            # With a TP group, the trial run would launch the segment's collectives on this rank alone.
            return ""
        try:
            node = failing_node(module, sargs, self.executor.trial)
        except Exception:  # a diagnosis must never hide the failure it explains
            return ""
        return "" if node is None else f" (at {describe_node(node)})"

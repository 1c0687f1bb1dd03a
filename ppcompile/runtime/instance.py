"""``StageInstance``: the captured state of one stage graph for one set of module-state tensors, and
everything a graph-path call does with it.

Graphs read parameters and buffers in place and bake constant scalars, so they belong to the module
instance they were captured with: a ``StageRuntime`` keeps one ``StageInstance`` per set of module-state
tensors. An instance owns the static input buffers and bridges (allocated at the largest bucket, in the
traced layout), the executor with its captured (segment, bucket) graphs (made by the runtime's executor
factory), a slot table per captured bucket and the graph path bound to them (``graph_path.py``).

The runtime decides (policy): which bucket serves a call, whether to run eagerly, when and in which
order to capture, what a failure means for the group and the fall-off record. The instance does (its
own call): it is claimed for one call at a time (``claim``: ``ConcurrentCallError``), copies inputs
that alias its static memory, runs the graph path (``serve``), hands out owned copies and, in debug
mode, tracks what it handed out (``stale_outputs.py``, ``end_call``); it captures and keeps the
failure bookkeeping (``capture_all``: ``failed``; ``capture_lazily``: ``failed_buckets``).
"""

from __future__ import annotations

import logging
import threading
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import sympy
import torch

from ppcompile.config import PPBreakableConfig
from ppcompile.counters import counters
from ppcompile.runtime.capture_diagnosis import describe_node, failing_node
from ppcompile.runtime.compiled_stage import CompiledStage
from ppcompile.runtime.executors import ExecutorFactory, GraphExecutor, make_executor
from ppcompile.runtime.fused_copy import RowCopier, make_row_copier
from ppcompile.runtime.graph_path import GraphPath, RingSlots, Wrap, bind_graph_path, instrumented_path
from ppcompile.runtime.group_agreement import LOCAL, Agreement, GroupCaptureError
from ppcompile.runtime.observer import CaptureMeter, CaptureObserver, CaptureRecord, CaptureStart
from ppcompile.runtime.program import GraphStep, Ref
from ppcompile.runtime.stale_outputs import OutputTracker
from ppcompile.runtime.static_buffers import extent
from ppcompile.runtime.validation import aliased_slots, storages_of
from ppcompile.runtime.whole_stage import WholeGraphs

__all__ = ["ConcurrentCallError", "StageInstance"]

log = logging.getLogger(__name__)


class ConcurrentCallError(RuntimeError):
    """A compiled stage instance was entered while a call of it was still running."""


class StageInstance:
    """Static buffers, captured graphs and the graph-path call for one set of module-state tensors
    (read-only to callers: ``captured_buckets``, ``input_buffers``, ``bridge_buffers``,
    ``static_tensors()``, ``failed``, ``failed_buckets``, ``tracker``)."""

    def __init__(self, compiled: CompiledStage, config: PPBreakableConfig, args: Sequence[Any],
                 env_max: dict[sympy.Symbol, int], runs: list[CaptureRecord] | None = None,
                 agreement: Agreement = LOCAL, executor: ExecutorFactory = make_executor,
                 live_forward: Callable[..., Any] | None = None) -> None:
        program = compiled.program
        self._compiled = compiled
        self._config = config
        # Strong references: the graphs read them (and bake scalars).
        self.module_state = tuple(args[i] for i in (*compiled.state_slots, *compiled.scalar_slots))
        self.executor: GraphExecutor = executor(compiled.graph_mode, config.debug, self._device(), agreement)
        # Static buffers by slot, in the plan's order (inputs, then bridges), in their traced layout; a
        # bridge that shares an earlier one's buffer is that buffer.
        owned = {s: plan.allocate(env_max) for s, plan in program.buffers.items() if plan.shares_with is None}
        self._buffers = {s: owned[s if plan.shares_with is None else plan.shares_with]
                         for s, plan in program.buffers.items()}
        # One fused copier per copy point (``Program.copy_points``), or None: per-tensor torch ops.
        self.copiers: tuple[Callable[..., None] | None, ...] | None = self._copiers(config.copy_kernel)
        self.tables: dict[int, list[Any]] = {}  # bucket -> slot table
        # The graph path, generated once and bound per bucket (``graph_path.py``); instrumented variants.
        self.ring = self._ring(env_max)
        assert compiled.token_symbol is not None, "a stage without a token count has no graph path"
        self.forward: GraphPath = bind_graph_path(program, compiled.name, compiled.token_symbol, self.tables,
                                                  self.executor, config.debug, self.copiers, ring=self.ring)
        self._instrumented: dict[int, tuple[Wrap, GraphPath]] = {}
        self.failed: str | None = None  # capture="all": graphs are off for this instance
        self.failed_buckets: dict[int, str] = {}  # capture="lazy": buckets that run eagerly
        self.failed_at: int | None = None  # the bucket the last capture run failed at
        # Held for the duration of a graph-path call: a second concurrent entry raises, never waits.
        self._lock = threading.Lock()
        self._owner = 0  # thread ident of the call holding ``_lock``
        self._storages: frozenset[int] | None = None  # static memory, for the aliased-input check
        self._tracker: OutputTracker | None = None  # debug: outputs handed out, expired at the next call
        self._own_outputs = config.owned_outputs or config.debug
        self._track_outputs = config.debug and not config.owned_outputs
        self._warned_aliased = False
        # Capture runs are appended here (the runtime's list, oldest first).
        self.runs: list[CaptureRecord] = [] if runs is None else runs
        # The TP group's ranks capture alike: budget ends and failures are agreed (group_agreement.py).
        self._agreement = agreement
        # Whole-stage graphs of small buckets (``whole_stage.py``), with an executor of their own.
        self.whole: WholeGraphs | None = None
        if compiled.whole is not None and live_forward is not None:
            self.whole = WholeGraphs(
                compiled.whole, compiled.plan.sizes, live_forward,
                executor(compiled.graph_mode, config.debug, self._device(), agreement), compiled.token_symbol,
                compiled.name, bool(config.owned_outputs or config.debug or config.output_slots > 1))
        # Outputs that are graph memory (graph outputs handed out as live-size views): owned copies copy them.
        self._static_outputs = frozenset(s for st in program.graph_steps for s in st.live_views)

    # ----------------------------------------------------------------------------------- a call
    def claim(self, stage: str) -> StageInstance:
        """Takes this instance for one call, ``with state.claim(stage): ...`` (``stage``: the stage
        graph's name, for the error): a second entry while a call holds it raises
        :class:`ConcurrentCallError`, never waits."""
        if not self._lock.acquire(blocking=False):
            raise self._concurrent_call_error(stage)
        self._owner = threading.get_ident()
        return self

    def __enter__(self) -> StageInstance:
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def _concurrent_call_error(self, stage: str) -> ConcurrentCallError:
        if self._owner == threading.get_ident():
            how = "re-entered from the thread that is running it (a break op calling its own stage?)"
        else:
            how = f"called from thread {threading.get_ident()} while thread {self._owner} is running it"
        return ConcurrentCallError(
            f"pp_breakable: {stage} was {how}. A compiled stage instance serves one call at a time "
            "(its static buffers hold that call's data): use one compiled stage per thread, or serialize "
            "calls with a lock"
        )

    def serve(self, args: tuple[Any, ...], env_n: dict[sympy.Symbol, int], n: int, b: int,
              wrap: Wrap | None = None) -> tuple[Any, ...]:
        """A claimed call of ``n`` live tokens at captured bucket ``b`` on the graph path (its parts
        wrapped by ``wrap``, if given): inputs that share this instance's static memory are copied
        first, outputs in static memory are handed out as copies (``owned_outputs``; tracked in debug)."""
        if self._storages is None:
            self._storages = storages_of(self.static_tensors())
        aliased = aliased_slots(args, self._compiled.tensor_slots, self._storages)
        if aliased:
            args = self._copy_aliased(args, aliased)
        forward = self.forward if wrap is None else self.instrumented(wrap)
        outputs = forward(args, env_n, n, b)
        counters.replays += 1
        counters.replays_by_bucket[b] += 1
        if not self._own_outputs:
            return outputs
        copied: list[int] = []
        outputs = self._own(outputs, copied)
        if self._track_outputs and copied:
            if self._tracker is None:
                self._tracker = OutputTracker(self._compiled.name, self._config.output_slots)
            self._tracker.hand_out((i, outputs[i]) for i in copied)
        return outputs

    def end_call(self) -> None:
        """Debug mode: a call of this module instance ended (served any way, or failed); the outputs it
        handed out a lifetime ago expire (``stale_outputs.py``)."""
        if self._tracker is not None:
            self._tracker.end_call()

    @property
    def tracker(self) -> OutputTracker | None:
        """Debug mode: the outputs handed out and not yet expired (None before the first)."""
        return self._tracker

    def _copy_aliased(self, args: tuple[Any, ...], slots: list[int]) -> tuple[Any, ...]:
        """Inputs that share memory with this instance's static buffers (an output of the previous call
        fed back in) are copied first: the call overwrites that memory while it may still read them."""
        if not self._warned_aliased:
            self._warned_aliased = True
            log.info("%s: input slot(s) %s share memory with the stage's own static buffers (an output of "
                     "an earlier call?); such inputs are copied before the call", self._compiled.name, slots)
        copied = list(args)
        for s in slots:
            copied[s] = args[s].clone()
        return tuple(copied)

    def _own(self, outputs: tuple[Any, ...], copied: list[int]) -> tuple[Any, ...]:
        """``outputs`` with copies of those in this instance's static memory (graph outputs, and anything
        whose storage is static, like a break op's view of one); their indices go to ``copied``."""
        static = self._storages or frozenset()
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
        if self.whole is not None:
            yield from self.whole.static_tensors()
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
            assert compiled.token_symbol is not None
            path = instrumented_path(self.forward, compiled.program, compiled.name, compiled.token_symbol,
                                     wrap, self._config.debug)
            cached = self._instrumented[id(wrap)] = (wrap, path)
        return cached[1]

    # ----------------------------------------------------------------------------------- capture
    def _device(self) -> torch.device | None:
        """Where the stage's graphs run: its static buffers' device, else its parameters'."""
        for plan in self._compiled.program.buffers.values():
            return plan.spec.device
        return next((t.device for t in self.module_state if isinstance(t, torch.Tensor)), None)

    def _forget(self, bucket: int | None = None) -> None:
        """A table was made or dropped: every graph path binds ``bucket`` (None: every bucket) again."""
        for path in (self.forward, *(p for _, p in self._instrumented.values())):
            path.forget(bucket)
        self._storages = None  # static memory changed: the aliased-input check recomputes it

    def capture_all(self, args: Sequence[Any], env: dict[sympy.Symbol, int], buckets: Sequence[int],
                    observer: CaptureObserver) -> None:
        """``capture="all"``: every one of ``buckets``. A failure turns graphs off for this instance
        (``failed`` says why; every graph is released) and raises."""
        try:
            self.capture(args, env, buckets, observer)
        except BaseException as e:
            self.failed = f"{type(e).__name__}: {e}"
            self.tables.clear()
            self._forget()
            self.executor.release()
            raise

    def capture_lazily(self, args: Sequence[Any], env: dict[sympy.Symbol, int], order: Sequence[int],
                       observer: CaptureObserver, budget_s: float | None) -> tuple[int, str] | None:
        """``capture="lazy"``: ``order``'s buckets (its first always, the rest while ``budget_s`` lasts).
        A failure marks its bucket failed (``failed_buckets``; its graphs are dropped) and is returned as
        ``(bucket, why)``; the buckets captured before it keep their graphs. None: no failure."""
        try:
            self.capture(args, env, order, observer, budget_s)
        except Exception as e:
            failed = order[0] if self.failed_at is None else self.failed_at  # a budget may go on past it
            self.failed_buckets[failed] = f"{type(e).__name__}: {e}"
            self.executor.forget(failed)
            self._forget(failed)
            return failed, self.failed_buckets[failed]
        return None

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
        meter = CaptureMeter(compiled.graph_mode, len(graph_steps), held, start, self._device())
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
                    self._forget(b)
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

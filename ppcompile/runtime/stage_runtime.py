"""``StageRuntime``: serves each call of a compiled stage by a captured bucket or eagerly.

Per call with ``n`` live tokens:

1. pick the bucket ``b >= n`` (O(1) table); above the cap, beyond the padding guard, with autograd on,
   or for a stage that cannot be graphed, run every segment eagerly on live tensors instead (a stage with
   whole-stage graphs serves a forward that fits one from a whole graph first, padding guard or not:
   ``whole_stage.py``);
2. check the inputs against the compiled graph (``validation.py``; before any capture or write; the first
   call of a recompile for inputs of another structure runs eagerly, ``_probe``), then copy them into
   the static input buffers (``[:n]``) and zero their padding rows (``[n:b]``);
3. walk the segments: a graph segment replays its bucket-``b`` graph; a break segment runs eagerly on
   ``[:n]`` views and its outputs that graphs read are copied into static bridges;
4. return outputs trimmed to their live size: copies of those in static memory (the default,
   ``owned_outputs``), or with ``owned_outputs=False`` views valid until the next call (with
   ``debug=True``, copies that expire then, ``stale_outputs.py``).

The runtime keeps the policy: which bucket, the eager fallbacks, when and in which order to capture
(``capture_policy.py``), the group's agreement, fall-offs. Graphs and static buffers belong to the module
state they read: one ``StageInstance`` per set of parameter tensors (``instance.py``), which owns its call
(one at a time, ``ConcurrentCallError``; aliased inputs, owned outputs, stale-output tracking) and its
capture bookkeeping; the runtime reads its state and assigns none. Its executors come from the runtime's
executor factory (``executor=`` / :meth:`StageRuntime.use_executor`; default
``executors.make_executor``). What each failure leaves behind is in docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import sympy
import torch

from ppcompile.config import PPBreakableConfig
from ppcompile.counters import counters
from ppcompile.planning.traffic import TokenHistogram, process_histogram
from ppcompile.runtime.capture_policy import CapturePolicy, items_of
from ppcompile.runtime.codegen import make_live_forward
from ppcompile.runtime.compiled_stage import CompiledStage
from ppcompile.runtime.executors import ExecutorFactory, make_executor
from ppcompile.runtime.fall_offs import (
    BUCKET_CAPTURE_FAILED,
    CAPTURE_FAILED,
    FALL_OFF_CAUSES,
    NEVER_GRAPHS,
    RECOMPILE_LIMIT,
    FallOffs,
)
from ppcompile.runtime.graph_path import Wrap
from ppcompile.runtime.group_agreement import Agreement, agreement_for
from ppcompile.runtime.inspection import StageInspection
from ppcompile.runtime.instance import ConcurrentCallError, StageInstance
from ppcompile.runtime.observer import NO_OBSERVER, CaptureObserver, CaptureRecord
from ppcompile.runtime.sibling_graphs import StaticCalls
from ppcompile.runtime.state_match import StateMatcher
from ppcompile.runtime.token_counts import TokenCounts
from ppcompile.runtime.validation import InputMismatchError, check_inputs

__all__ = ["BUCKET_CAPTURE_FAILED", "CAPTURE_FAILED", "FALL_OFF_CAUSES", "NEVER_GRAPHS",
           "RECOMPILE_LIMIT", "ConcurrentCallError", "StageRuntime"]

log = logging.getLogger(__name__)


class StageRuntime(StageInspection, CapturePolicy):
    """The callable the ``pp_breakable`` backend hands back to Dynamo for one stage graph (its inspection
    and instrumentation API, ``describe()``, ``instances()``, ``instrumented(...)``, ..., is in
    ``inspection.py``)."""

    def __init__(self, compiled: CompiledStage, config: PPBreakableConfig,
                 observer: CaptureObserver | None = None, executor: ExecutorFactory | None = None) -> None:
        """``compiled``: everything the compile side decided (frozen); ``observer``: told about each capture
        run (``runtime/observer.py``; the backend wires up the debug recorder); ``executor``: makes each
        module instance's executor (default ``executors.make_executor``; see :meth:`use_executor`)."""
        self.compiled = compiled
        self.config = config
        self._observer = observer or NO_OBSERVER
        self._executor: ExecutorFactory = executor or make_executor
        self._states: dict[tuple[Any, ...], StageInstance] = {}
        # What each call reads, looked up once: the state tensors of its args, where its token count is.
        self._module_state_of = items_of(compiled.state_slots)
        self._matchers: dict[tuple[Any, ...], StateMatcher] = {}
        self._last_state: tuple[StageInstance, StateMatcher] | None = None
        self._token_slot = compiled.token_slot
        self._token_dim = compiled.token_input or (0, 0)  # where the count is when no input holds it
        assert compiled.token_symbol is None or (self._token_slot, compiled.token_input) != (None, None)
        self._symbol_slots = compiled.symbol_slots
        self._capture_runs: list[CaptureRecord] = []  # every instance's capture runs, oldest first
        self.live_forward = make_live_forward(compiled.program, compiled.name, compiled.live_checks)
        self._wrap: Wrap | None = None  # instrumented(): the hook its block wraps graph paths with
        self._warned: set[str] = set()
        # Reliability (docs/reliability.md): input checks, aliased inputs, debug stale-output tracking.
        self._token_source = self.token_source()
        self._capture_lock = threading.RLock()
        self._debug = config.debug
        self._probe_inputs = bool(compiled.record.input_changes)  # _probe: until a first call succeeds
        # A static stage graph's calls, handed to a symbolic one of its module (sibling_graphs.py).
        self.served_by: StaticCalls | None = None
        # Live token counts served (a static graph has none); they also feed the process-wide histogram.
        self.traffic = TokenHistogram(feeds=process_histogram())
        self._fall_offs = FallOffs(compiled.record, lambda: self.label)  # note_fall_off
        self.token_counts = TokenCounts(compiled, lambda: self.label)  # merged token dims, checked per call
        # A stage with collectives decides alike on every rank of its TP group (group_agreement.py).
        self._agreement = agreement_for(config.tp_group, compiled.collectives, compiled.name)
        self._options_key = int(config.compute_hash()[:15], 16)
        if compiled.never_graphs and compiled.eager_reason:
            self.note_fall_off(NEVER_GRAPHS, f"every forward runs eagerly: {compiled.eager_reason}")
        elif self.eager_reason:
            log.info("%s: every forward runs eagerly: %s", self.name, self.eager_reason)

    # ----------------------------------------------------------------------------------- state
    def instances(self) -> tuple[StageInstance, ...]:
        """The captured state of each module instance served so far, in order of first call (read-only:
        buckets, buffers, static tensors)."""
        return tuple(self._states.values())

    def capture_records(self) -> list[CaptureRecord]:
        """Every capture run so far (of any module instance), oldest first: time and memory per bucket
        (``observer.CaptureRecord``)."""
        return list(self._capture_runs)

    def use_executor(self, factory: ExecutorFactory) -> None:
        """Makes the executor of every module instance this runtime captures from now on with
        ``factory(mode, debug, device, agreement)`` (``executors.ExecutorFactory``: a subclass of the
        default executor that injects faults, say). Only before the first instance exists: for a runtime
        the backend builds, from an ``observe.hooks.StageHooks(built=...)`` hook."""
        if self._states:
            raise RuntimeError(f"pp_breakable: {self.name} already serves module instances; set its "
                               "executor before the first call that captures")
        self._executor = factory

    @contextlib.contextmanager
    def instrumented(self, wrap: Wrap) -> Iterator[None]:
        """While open, graph-path calls run with their parts wrapped by ``wrap(category, fn)``, one
        category per kind of work (``graph_path.CATEGORIES``: graph replays, break segments, copy-in,
        bridge copies, output copies), for profilers and benchmarks (``bench/overhead.py``,
        ``bench/launches.py``). Each instance binds the wrapped path at its first call inside a block and
        keeps it for later blocks with the same ``wrap``; calls outside run the plain path. Not for use
        while other threads call the stage."""
        saved, self._wrap = self._wrap, wrap
        try:
            yield
        finally:
            self._wrap = saved

    def num_tokens(self, args: tuple[Any, ...]) -> int:
        """The live token count of a call."""
        if self._token_slot is not None:
            return int(args[self._token_slot])
        i, d = self._token_dim
        return int(args[i].shape[d])

    def _env(self, args: tuple[Any, ...], tokens: int) -> dict[sympy.Symbol, int]:
        env = {e: int(args[i]) for i, e in self._symbol_slots} if self._symbol_slots else {}
        token = self.compiled.token_symbol
        if token is not None:
            env[token] = tokens
        return env

    @property
    def agreement(self) -> Agreement:
        """How this stage's TP group agrees (``size`` 1: alone; ``collectives``: how many it issued)."""
        return self._agreement

    def note_fall_off(self, cause: str, message: str) -> None:
        """Records that forwards stop reaching the graph path for ``cause`` (one of
        :data:`FALL_OFF_CAUSES`, none a documented policy): ``fall_offs()``, ``describe()`` and the report
        list it; one warning naming the stage, the cause and ``message`` (what happened, and the fix) and
        ``counters.fall_offs``, once per module and cause (``fall_offs.py``)."""
        self._fall_offs.note(cause, message)

    def fall_offs(self) -> dict[str, str]:
        """The causes this stage graph fell off the graph path for, with what happened and the fix."""
        return self._fall_offs.as_dict()

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    # ----------------------------------------------------------------------------------- call
    def __call__(self, *args: Any) -> tuple[Any, ...]:
        if self.compiled.bound_inputs:
            args = (*args, *self.compiled.bound_inputs)
        if self._debug:
            return self._call_debug(args)
        return self._call(args)

    def _call(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        # The hot path: the compiled stage's facts are read once into locals.
        compiled = self.compiled
        if compiled.token_symbol is None:  # concrete sizes: no token count to record or pad
            return self.run_eager(args) if self.served_by is None else self.served_by(args)
        n = self.num_tokens(args)
        if self._agreement.size > 1:
            self._agreement.check_call([n, self._options_key, len(compiled.plan.sizes)], compiled.name,
                                       self._debug)
        if n > 0:  # an empty batch is not traffic
            self.traffic.record(n)
        if self.token_counts.differ(args, n):
            return self.token_counts.run_eager(args)
        if compiled.eager_reason is not None:
            return self.run_eager(args)
        b = compiled.plan.bucket(n)
        whole_plan = compiled.whole  # beyond the padding guard, a whole-stage graph may still serve
        if b is None and (whole_plan is None or n > whole_plan.max_tokens):
            return self.run_eager(args)
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            self._warn_once("grad", "%s: inputs require grad with autograd enabled, so forwards run "
                            "eagerly; run inference under torch.inference_mode() or torch.no_grad() to "
                            "use graphs", compiled.name)
            return self.run_eager(args)
        if self._probe_inputs:
            return self._probe(args)
        env_n = self._env(args, n)
        # Checked before anything is captured or written: a rejected call leaves every buffer as it was.
        check_inputs(compiled.input_specs, args, compiled.program.num_inputs, env_n, compiled.name,
                     self._token_source)
        state = self._state_for(args)
        if state.failed is not None:
            return self.run_eager(args)  # the fall-off was noted when the capture failed
        with state.claim(compiled.name):
            whole = state.whole
            if whole is not None and (wb := self._whole_bucket(whole, args, n)) is not None:
                return whole.serve(args, env_n, n, wb)
            if b is None:
                return self.run_eager(args)
            if b not in state.tables and not self._capture_lazily(state, args, b):
                return self.run_eager(args)
            return state.serve(args, env_n, n, b, self._wrap)

    def _probe(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The first call of a recompile for inputs of another structure (``record.input_changes``: most
        likely a bad input) runs eagerly: a bad input raises, named, before any capture."""
        record = self.compiled.record
        try:
            outputs = self.run_eager(args)
        except Exception as e:
            raise InputMismatchError(
                f"pp_breakable: {self.label} was compiled for a call whose inputs differ in structure from "
                f"the earlier calls' of its module ({'; '.join(record.input_changes)}), and the forward "
                f"fails on them without graphs ({type(e).__name__}: {e}): fix the inputs named. Calls that "
                "match the earlier ones are still served by their stage graph") from e
        self._probe_inputs = False
        return outputs

    def _call_debug(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """``debug=True``: a call, then the outputs of the call before it expire (stale_outputs.py)."""
        try:
            return self._call(args)
        finally:
            state = None
            if self.eager_reason is None:
                with contextlib.suppress(Exception):  # args so bad that they have no state key
                    state = self._states.get(self._state_key(args))
            if state is not None:
                state.end_call()

    def run_eager(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """Every segment on live tensors: no static buffers, no graphs (``codegen.py``)."""
        counters.eager_runs += 1
        env = self._env(args, self.num_tokens(args)) if self.token_symbol is not None else self._env(args, 0)
        return self.live_forward(args, env)

"""How a ``StageRuntime`` captures: which module instance a call belongs to, when and what to capture,
and what a failed capture means.

Graphs read module state in place, so a call's module-state tensors (by identity) and baked scalars (by
value) pick its ``StageInstance`` (``_state_for``); a new one is captured, with ``capture="all"`` every
bucket at once (``_capture``), with ``"lazy"`` each bucket at its first use (``_capture_lazily``), the
whole-stage buckets too (``_whole_bucket``). A failure that the forward also raises without graphs is the
model's error and is raised as such; any other turns graphs off for the instance, or the bucket, with a
fall-off (``fall_offs.py``). ``StageRuntime`` inherits this from :class:`CapturePolicy`.
"""

from __future__ import annotations

import logging
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch

from ppcompile.config import PPBreakableConfig
from ppcompile.errors import add_note
from ppcompile.planning.traffic import process_histogram
from ppcompile.runtime.codegen import LiveForward
from ppcompile.runtime.compiled_stage import CompiledStage
from ppcompile.runtime.executors import ExecutorFactory
from ppcompile.runtime.fall_offs import BUCKET_CAPTURE_FAILED, CAPTURE_FAILED, WHOLE_CAPTURE_FAILED, FallOffs
from ppcompile.runtime.group_agreement import Agreement, GroupDivergenceError
from ppcompile.runtime.instance import StageInstance
from ppcompile.runtime.observer import CaptureObserver, CaptureRecord
from ppcompile.runtime.state_match import StateMatcher, state_matcher
from ppcompile.runtime.whole_stage import WholeGraphs

__all__ = ["CapturePolicy", "items_of"]

log = logging.getLogger(__name__)


def items_of(slots: Sequence[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """A function returning ``tuple(args[i] for i in slots)``, in C (``operator.itemgetter``)."""
    if not slots:
        return lambda args: ()
    if len(slots) == 1:
        (slot,) = slots
        return lambda args: (args[slot],)
    return operator.itemgetter(*slots)


class CapturePolicy:
    """The module instances a runtime serves and when they capture (a mixin of ``StageRuntime``, which
    sets what is declared here)."""

    compiled: CompiledStage
    config: PPBreakableConfig
    live_forward: LiveForward
    _states: dict[tuple[Any, ...], StageInstance]
    _capture_lock: threading.RLock
    _capture_runs: list[CaptureRecord]
    _executor: ExecutorFactory
    _observer: CaptureObserver
    _agreement: Agreement
    _fall_offs: FallOffs
    _debug: bool
    _options_key: int  # the options' hash, compared across a TP group
    _module_state_of: Callable[[Sequence[Any]], tuple[Any, ...]]  # items_of(compiled.state_slots)
    _matchers: dict[tuple[Any, ...], StateMatcher]  # per instance key
    _last_state: tuple[StageInstance, StateMatcher] | None  # the last call's instance

    # StageRuntime's methods.
    num_tokens: Callable[[tuple[Any, ...]], int]
    _env: Callable[[tuple[Any, ...], int], dict[sympy.Symbol, int]]
    note_fall_off: Callable[[str, str], None]

    def _whole_bucket(self, whole: WholeGraphs, args: tuple[Any, ...], n: int) -> int | None:
        """The whole-stage bucket serving this call, captured at its first use, or None (breakable)."""
        wb = whole.bucket_for(args, n)
        if self._agreement.size > 1 and (self._debug or (wb is not None and not whole.captured(wb))):
            self._agreement.check_same("the whole-stage bucket", [wb or 0], self.compiled.name)
        if wb is None or whole.captured(wb):
            return wb
        failure = whole.capture(args, n, wb)
        self._note_whole_failure(wb, failure)
        return wb if failure is None else None

    def _note_whole_failure(self, wb: int, failure: str | None) -> None:
        if failure is not None:
            self.note_fall_off(WHOLE_CAPTURE_FAILED, f"the whole-stage graph of bucket {wb} failed to "
                               f"capture ({failure}); its forwards take the breakable path. Fix the op the "
                               "error names, or withdraw its capture declaration")

    def _state_key(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        # Graphs read module state in place and bake constant host scalars (a norm's eps) at capture:
        # key the captured graphs by the identity of the one and the value of the other, and by
        # inference mode, whose tensors (static buffers, graph outputs) cannot be written outside it. A
        # scalar on the device is read in place like state (and reading its value would sync per call).
        # Built when the last call's instance does not match (``_state_for``), in debug mode every call:
        # one pass over the state in C (``itemgetter``, ``map``), no Python loop.
        return (
            torch.is_inference_mode_enabled(),
            *map(id, self._module_state_of(args)),
            *[a.item() if (a := args[i]).device.type == "cpu" else id(a) for i in self.compiled.scalar_slots],
        )

    def _state_for(self, args: tuple[Any, ...]) -> StageInstance:
        """The instance ``args`` belong to, captured now if new: the last call's when its matcher says so
        (``state_match.py``: one generated expression), else the one of the call's key."""
        last = self._last_state
        if last is not None and last[1](args):
            return last[0]
        key = self._state_key(args)
        state = self._states.get(key)
        if state is None:
            with self._capture_lock:  # two threads' first calls capture once
                state = self._states.get(key)
                if state is None:
                    state = self._capture_or_explain(args, key)
        matcher = self._matchers.get(key)
        if matcher is None:
            compiled = self.compiled
            matcher = self._matchers[key] = state_matcher(compiled.state_slots, compiled.scalar_slots, args,
                                                          compiled.name)
        self._last_state = (state, matcher)
        return state

    def _capture_or_explain(self, args: tuple[Any, ...], key: tuple[Any, ...]) -> StageInstance:
        """``_capture``, with what happens next added to its error.

        A failed capture turns graphs off for this module instance (``state.failed``: later calls run
        eagerly, with a warning). An interrupt (``KeyboardInterrupt``, ``SystemExit``) is not a failure
        of the stage: the half-made state is dropped and the next call captures again.
        """
        try:
            return self._capture(args, key)
        except GroupDivergenceError:
            raise  # bad input: nothing was captured, and the next call tries again
        except Exception as e:
            stage = self.compiled.name
            eager_error = self._eager_error(args) if self._agreement.size == 1 else None
            if eager_error is not None:  # a bad input (or a model bug), not a capture failure
                self._states.pop(key, None)
                add_note(eager_error, f"pp_breakable: {stage}'s capture failed on this call, and the "
                         "forward fails without graphs too (this error): not a capture failure, so graphs "
                         "stay on and the next call captures again")
                raise eager_error from e
            add_note(e, f"pp_breakable: graphs are off for this module instance of {stage}; later "
                      "calls run eagerly")
            self.note_fall_off(CAPTURE_FAILED, f"graphs are off for a module instance after its capture "
                               f"failed ({type(e).__name__}: {e}); its forwards run eagerly. Fix the op the "
                               "error names, make it a break (split_ops), or use capture='lazy' to keep "
                               "the buckets that capture")
            if self._agreement.size > 1 and key in self._states:
                # Every rank saw it (settled): all serve eagerly; one that raised would strand the others.
                log.warning("%s: capture failed; every rank of the TP group serves eagerly", stage)
                return self._states[key]
            raise
        except BaseException as e:
            self._states.pop(key, None)
            add_note(e, f"pp_breakable: capture of {self.compiled.name} was interrupted; nothing it captured "
                      "is kept, and the next call captures again")
            raise

    def _eager_error(self, args: tuple[Any, ...]) -> Exception | None:
        """What the call raises on the live path (no graphs; not a served forward), or None."""
        try:
            self.live_forward(args, self._env(args, self.num_tokens(args)))
        except Exception as e:
            return e
        return None

    def _capture(self, args: tuple[Any, ...], key: tuple[Any, ...]) -> StageInstance:
        """A new instance (static buffers allocated); with ``capture="all"`` every (graph segment, bucket)
        captured, largest bucket first (one failure turns graphs off for the instance). ``"lazy"``
        captures nothing here: each bucket at its first use (``_capture_lazily``)."""
        n = self.num_tokens(args)
        env = self._env(args, n)
        env_max = {**env, self.compiled.token_symbol: max(self.compiled.plan.sizes)}
        state = StageInstance(self.compiled, self.config, args, env_max, runs=self._capture_runs,
                              agreement=self._agreement, executor=self._executor,
                              live_forward=self.live_forward)
        self._states[key] = state  # kept even when capture fails: later calls see state.failed
        if self.config.capture == "all":
            state.capture_all(args, env, sorted(self.compiled.plan.sizes, reverse=True), self._observer)
            if state.whole is not None:  # whole-stage buckets too, largest first, with no live row
                for wb in reversed(state.whole.buckets):
                    self._note_whole_failure(wb, state.whole.capture(args, n, wb, empty=True))
        return state

    def _capture_lazily(self, state: StageInstance, args: tuple[Any, ...], b: int) -> bool:
        """``capture="lazy"``: captures bucket ``b`` at its first use (at the first call of the instance,
        with a ``capture_budget_s``, more buckets in order of value until the budget is spent); True
        when ``b`` can replay. A bucket whose capture fails runs eagerly from then on, one warning."""
        if b in state.failed_buckets:
            return False
        order = [b]
        budget = self.config.capture_budget_s
        if budget is not None and not state.tables:
            order += [s for s in self.bucket_values() if s != b]
        n = self.num_tokens(args)
        self._agreement.check_same("the token count, bucket and options of a lazy capture",
                                   [n, b, self._options_key, len(order)], self.compiled.name)
        order = self._agreement.leader(order)  # the process's traffic may differ between ranks
        failure = state.capture_lazily(args, self._env(args, n), order, self._observer, budget)
        if failure is None:
            return True
        failed, why = failure
        what = (f"capture of bucket {failed} failed, so the forwards it would serve run eagerly (the "
                f"other buckets keep their graphs): {why}")
        if BUCKET_CAPTURE_FAILED in self._fall_offs:
            log.info("%s: %s", self.compiled.name, what)
        self.note_fall_off(BUCKET_CAPTURE_FAILED, f"{what}; fix the op the error names, or make it a "
                           "break (split_ops)")
        return b in state.tables

    def bucket_values(self) -> list[int]:
        """The buckets in the order a capture budget spends on them: by the live tokens the process has
        served with each (``ppcompile.token_histogram()``, e.g. merged from a saved traffic file before
        the first call), then largest first."""
        served = dict.fromkeys(self.compiled.plan.sizes, 0)
        for n, count in process_histogram().counts().items():
            b = self.compiled.plan.bucket(n)
            if b is not None:
                served[b] += count * n
        return sorted(self.compiled.plan.sizes, key=lambda s: (-served[s], -s))

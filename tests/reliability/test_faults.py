"""Faults during a forward or a capture (docs/reliability.md, "Faults").

A break op that raises (or is interrupted) mid-forward, a capture that fails, and an interrupt during
capture: the error propagates unchanged in type, with a note saying where it happened and what comes
next; the stage stays usable and the next call is correct (eagerly, with a warning, after a failed
capture); nothing half-written is ever served.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from reliability_helpers import HOOK, SIZES, Stage, check, compile_stage, inputs, only_state, runtime
from runtime_helpers import CaptureHooks, fail_at_bucket

from ppcompile import counters
from ppcompile.runtime.executors import Key


class OpFailure(RuntimeError):
    pass


def _raise_on(rows: int, exc: type[BaseException]) -> Any:
    """A hook raising a fresh ``exc`` (a shared instance would keep its traceback, and every runtime
    on it, alive for the whole session)."""

    def hook(x: torch.Tensor) -> None:
        if x.shape[0] == rows:
            raise exc(f"fault at {rows} rows (test)")

    return hook


def _notes(e: BaseException) -> str:
    return "\n".join(getattr(e, "__notes__", []))


@pytest.mark.parametrize("exc", [OpFailure, KeyboardInterrupt], ids=["exception", "KeyboardInterrupt"])
@pytest.mark.parametrize("mode", ["emulate", "eager"])
def test_a_break_op_that_raises_mid_forward(exc: type[BaseException], mode: str) -> None:
    m = Stage()
    c = compile_stage(m, graph_mode=mode)
    with torch.no_grad():
        kept = [t.clone() for t in check(c, m, *inputs(6, seed=1))]
        HOOK["fn"] = _raise_on(5, exc)
        with counters.expect(replays=0), pytest.raises(exc) as info:
            c(*inputs(5, seed=2))  # bucket 8, like the call before: its buffers get half rewritten
        assert "segment submod_1" in _notes(info.value) and "stays usable" in _notes(info.value)
        HOOK["fn"] = None
        for i, n in enumerate([5, 6, 8, 3, 16, 17]):
            check(c, m, *inputs(n, seed=10 + i))
        torch.testing.assert_close(check(c, m, *inputs(6, seed=1))[0], kept[0])


def test_a_break_op_that_raises_on_the_eager_path_gets_a_note() -> None:
    m = Stage()
    c = compile_stage(m)
    with torch.no_grad():
        HOOK["fn"] = _raise_on(17, OpFailure)
        with pytest.raises(OpFailure) as info:
            c(*inputs(17))  # above the cap: eager
        assert "segment submod_1" in _notes(info.value) and "eagerly" in _notes(info.value)
        HOOK["fn"] = None
        check(c, m, *inputs(17))


def test_a_failed_capture_raises_with_context_then_runs_eagerly_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    m = Stage()
    c = compile_stage(m)
    hooks = CaptureHooks(on_capture=fail_at_bucket(8, MemoryError, "no room for bucket 8 (test)"))
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="ppcompile"), hooks.injected():
        with pytest.raises(RuntimeError, match=r"segment submod_0 .* bucket 8 failed: MemoryError") as info:
            c(*inputs(5))
        assert "graphs are off" in _notes(info.value)
        state = only_state(runtime())
        assert state.failed is not None and not state.tables and state.executor.num_captured() == 0
        for i, n in enumerate([5, 16, 3, 9]):
            with counters.expect(replays=0, eager_runs=1, captures=0):
                check(c, m, *inputs(n, seed=i))
    # One warning, when the capture failed (a fall-off: counted and listed too), none per later call.
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "capture failed" in warnings[0] and "MemoryError" in warnings[0]
    assert "run eagerly" in warnings[0] and list(runtime().fall_offs()) == ["capture failed"]


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupted_capture_keeps_nothing_and_the_next_call_captures_again(
    interrupt: type[BaseException],
) -> None:
    def interrupt_once(key: Key) -> None:
        if len(hooks.keys) == 3:  # after bucket 16 was captured
            raise interrupt()

    hooks = CaptureHooks(on_capture=interrupt_once)
    m = Stage()
    c = compile_stage(m)
    with torch.no_grad(), hooks.injected():
        with pytest.raises(interrupt) as info:
            c(*inputs(5))
        assert "interrupted" in _notes(info.value) and "captures again" in _notes(info.value)
        rt = runtime()
        assert not rt.instances(), "a half-captured state must not be kept"
        with counters.expect(replays=1, eager_runs=0, captures=2 * len(SIZES)):
            check(c, m, *inputs(5))
        for i, n in enumerate([9, 3, 16]):
            with counters.expect(replays=1, captures=0):
                check(c, m, *inputs(n, seed=i))
        assert only_state(rt).failed is None


def test_an_interrupt_inside_a_graph_segment_during_replay() -> None:
    m = Stage()
    c = compile_stage(m)

    def interrupting(category: str, fn: Any) -> Any:
        def interrupted(*args: Any) -> Any:  # a bound replay of one graph step at one bucket
            raise KeyboardInterrupt

        return interrupted if category == "graph replays" else fn

    with torch.no_grad():
        check(c, m, *inputs(9))
        with runtime().instrumented(interrupting), pytest.raises(KeyboardInterrupt) as info:
            c(*inputs(12))
        assert "segment submod_0" in _notes(info.value)
        check(c, m, *inputs(12, seed=3))
        check(c, m, *inputs(9, seed=4))

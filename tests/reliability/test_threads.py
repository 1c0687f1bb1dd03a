"""Thread-safety rule (docs/reliability.md, "Threads"): one compiled stage instance serves one call at
a time. A second concurrent entry (another thread, or a re-entry from the running call) raises
``ConcurrentCallError`` at once instead of corrupting the static buffers; separate instances, which
have separate buffers, may run concurrently even when they share one compiled graph."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from reliability_helpers import HOOK, Stage, assert_matches, check, compile_stage, inputs, runtime

from ppcompile import counters
from ppcompile.runtime.stage_runtime import ConcurrentCallError

TIMEOUT = 30.0


def _in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            with torch.no_grad():
                result["value"] = fn()
        except BaseException as e:
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result


def test_a_second_thread_entering_a_running_stage_gets_a_clear_error() -> None:
    m = Stage()
    c = compile_stage(m)
    entered, release = threading.Event(), threading.Event()

    def block(x: torch.Tensor) -> None:
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            assert release.wait(TIMEOUT)

    with torch.no_grad():
        check(c, m, *inputs(5))  # compile and capture first
        HOOK["fn"] = block
        args = inputs(6, seed=1)
        thread, result = _in_thread(lambda: c(*args))
        assert entered.wait(TIMEOUT)
        with pytest.raises(ConcurrentCallError, match=r"called from thread \d+ while thread \d+ is running it"
                           r".*one compiled stage per thread, or serialize calls with a lock"):
            c(*inputs(7))
        release.set()
        thread.join(TIMEOUT)
        assert "error" not in result, result
        assert_matches(result["value"], m(*args))
        HOOK["fn"] = None
        check(c, m, *inputs(7, seed=2))  # nothing left locked


def test_re_entering_a_stage_from_its_own_break_op_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo is off inside a custom op, so only a direct call of the runtime can re-enter it."""
    m = Stage()
    c = compile_stage(m)
    with torch.no_grad():
        check(c, m, *inputs(5))
        rt = runtime()
        seen: list[tuple[Any, ...]] = []
        real = type(rt).__call__  # what Dynamo hands the runtime: recorded once
        monkeypatch.setattr(type(rt), "__call__", lambda self, *args: seen.append(args) or real(self, *args))
        check(c, m, *inputs(5))
        monkeypatch.undo()

        def reenter(x: torch.Tensor) -> None:
            HOOK["fn"] = None
            rt(*seen[0])

        HOOK["fn"] = reenter
        with pytest.raises(ConcurrentCallError, match="re-entered from the thread that is running it"):
            c(*inputs(6))
        check(c, m, *inputs(6))


def test_separate_instances_run_concurrently_and_correctly() -> None:
    """Two instances share one compiled graph (one runtime) but not buffers: both run at once."""
    m1, m2 = Stage(seed=1), Stage(seed=2)
    c1, c2 = compile_stage(m1), compile_stage(m2)
    with torch.no_grad():
        check(c1, m1, *inputs(5))
        check(c2, m2, *inputs(5))
    assert counters.backend_compiles == 1 and len(runtime().instances()) == 2
    both_inside = threading.Barrier(2, timeout=TIMEOUT)
    met: list[bool] = []

    def meet(x: torch.Tensor) -> None:
        if not met:
            both_inside.wait()  # both threads are inside a graph-path call of the same runtime
            met.append(True)

    HOOK["fn"] = meet

    def run(c: Any, m: Stage, seed: int) -> list[tuple[Any, Any]]:
        out = []
        for i, n in enumerate([6, 12, 3, 16, 9, 5, 8]):
            args = inputs(n, seed=seed + i)
            got = tuple(t.clone() for t in c(*args))
            out.append((got, m(*args)))
        return out

    threads = [_in_thread(lambda c=c, m=m, s=s: run(c, m, s)) for c, m, s in ((c1, m1, 0), (c2, m2, 100))]
    for t, _ in threads:
        t.join(TIMEOUT)
    for _, result in threads:
        assert "error" not in result, result
        for got, want in result["value"]:
            assert_matches(got, want)
    assert met

"""Progress on long work: a bar on a terminal, one log line per stage elsewhere; capture time and memory
logged per bucket."""

from __future__ import annotations

import io
import logging
import re

import pytest
from debug_helpers import SIZES, compile_stage

from ppcompile import envs
from ppcompile.observe.progress import Progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _run(stream: io.StringIO, clock: _Clock, steps: int = 5) -> Progress:
    p = Progress("capture g", steps, "buckets", stream=stream, delay_s=0.5, min_interval_s=0.1, clock=clock)
    for i in range(steps):
        clock.now += 0.3
        p.advance(note=f"bucket {i}")
    p.finish("done")
    return p


def test_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("PPCOMPILE_PROGRESS", raising=False)
    tty, clock = _Tty(), _Clock()
    with caplog.at_level(logging.INFO, logger="ppcompile.observe.progress"):
        _run(tty, clock)
    frames = tty.getvalue().split("\r")[1:]
    assert frames[0].startswith("capture g [") and "2/5 buckets" in frames[0]  # not before 0.5 s
    assert "   0.6s" in frames[0] and "bucket 1" in frames[0]
    assert re.search(r"\[#{24}\] 5/5 buckets +1\.5s\s*\n$", frames[-1])  # completed, then a newline
    assert [r.getMessage() for r in caplog.records] == ["capture g: done"]


def test_short_work_draws_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PPCOMPILE_PROGRESS", raising=False)
    tty, clock = _Tty(), _Clock()
    p = Progress("g", 3, "passes", stream=tty, clock=clock)
    p.advance()
    p.finish("ok")
    assert tty.getvalue() == ""


def test_log_line_only_off_a_terminal(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("PPCOMPILE_PROGRESS", raising=False)
    pipe = io.StringIO()
    with caplog.at_level(logging.INFO, logger="ppcompile.observe.progress"):
        _run(pipe, _Clock())
    assert pipe.getvalue() == ""
    assert len(caplog.records) == 1


def test_env_var_forces_the_bar_on_and_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPCOMPILE_PROGRESS", "off")
    tty = _Tty()
    _run(tty, _Clock())
    assert tty.getvalue() == ""
    monkeypatch.setenv("PPCOMPILE_PROGRESS", "on")
    pipe = io.StringIO()
    _run(pipe, _Clock())
    assert "5/5 buckets" in pipe.getvalue()
    monkeypatch.setenv("PPCOMPILE_PROGRESS", "sometimes")
    with pytest.raises(ValueError, match="PPCOMPILE_PROGRESS"):
        envs.progress()


def test_abort_ends_the_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPCOMPILE_PROGRESS", "on")
    out, clock = io.StringIO(), _Clock()
    p = Progress("g", 4, "buckets", stream=out, clock=clock)
    clock.now += 1.0
    p.advance()
    p.abort()
    assert out.getvalue().endswith("1/4 buckets    1.0s\n")


def test_capture_logs_time_and_memory_per_bucket(caplog: pytest.LogCaptureFixture) -> None:
    stage = compile_stage({})
    with caplog.at_level(logging.DEBUG, logger="ppcompile"):
        stage.call(10)
    per_bucket = [r.getMessage() for r in caplog.records if r.name == "ppcompile.debug.capture"]
    assert len(per_bucket) == len(SIZES)
    # Largest bucket first; the smaller ones capture into its output memory: no new bytes.
    for i, (msg, b) in enumerate(zip(per_bucket, sorted(SIZES, reverse=True))):
        held = r"[\d.]+ KiB" if i == 0 else "0 B"
        assert re.fullmatch(rf"stage_graph_\w+: bucket {b}: 2 graphs in [\d.]+ ms, outputs {held}", msg)
    stages = [r.getMessage() for r in caplog.records if r.name == "ppcompile.observe.progress"]
    assert len(stages) == 2  # one line for the compile's passes, one for the capture
    assert re.search(r"compile stage_graph_\w+: \d+ passes in [\d.]+ s", stages[0])
    assert re.search(r"capture stage_graph_\w+: captured 8 graphs \(2 segments x 4 buckets, emulate\) "
                     r"in [\d.]+ s; graph outputs hold [\d.]+ KiB; slowest bucket \d+", stages[1])

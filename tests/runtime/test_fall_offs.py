"""No silent fall-off: a stage graph whose forwards stop reaching the graph path for a reason other than
the documented policy says so once per cause (a warning naming the stage, the cause and the fix), counts
it (``ppcompile.counters.fall_offs``) and lists it (``fall_offs()``, ``describe()``, the report)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from runtime_helpers import CaptureHooks
from tiny_stage import H, Tiny, call

import ppcompile
from ppcompile.debug.html import render_html
from ppcompile.debug.report import build_report
from ppcompile.debug.table import format_report
from ppcompile.runtime.executors import Key
from ppcompile.runtime.stage_runtime import StageRuntime

OPTIONS = {"graph_mode": "emulate", "capture_sizes": [8, 16]}
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class ChunkPadder(Tiny):
    """Pads the tokens up to a multiple of 16 as chunked scans do: traced at 15 tokens (a 1-row pad,
    which Dynamo specialises), the graph's guards admit counts with ``n % 16 == 15`` only, and no
    bucket is one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = self.lin(torch.ones((16 - x.shape[0] % 16) % 16, H))
        chunked = torch.cat([self.lin(x), pad]).view(-1, 16, H).cumsum(1).view(-1, H)
        return self.lin(chunked[: x.shape[0]])


def _only(c: Any) -> StageRuntime:
    (rt,) = ppcompile.runtimes_of(c)
    return rt


def _warnings(caplog: pytest.LogCaptureFixture, cause: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelname == "WARNING" and f": {cause}: " in r.getMessage()]


def test_a_graph_whose_guards_refuse_every_bucket_says_it_never_graphs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    c = torch.compile(ChunkPadder(), backend="pp_breakable", options=OPTIONS)
    with caplog.at_level("WARNING", logger="ppcompile"), ppcompile.counters.expect(
            fall_offs={"never graphs": 1}, replays=0):
        for _ in range(3):
            call(c, 15)
    rt = _only(c)
    (warning,) = _warnings(caplog, "never graphs")
    assert rt.name in warning and "guards fail at 8, 16" in warning and "capture_sizes" in warning
    assert "never graphs" in rt.fall_offs() and "fell off the graph path (never graphs)" in rt.describe()
    report = build_report(rt)
    assert report["fall_offs"] == rt.fall_offs() and report["buckets"]["summary"]["max_waste"] is None
    assert "no bucket" in format_report(report, "dumps") and "no bucket" in render_html(report)


def test_a_failed_capture_is_one_warning_and_one_count(caplog: pytest.LogCaptureFixture) -> None:
    def fail(key: Key) -> None:
        raise RuntimeError("no memory")

    c = torch.compile(Tiny(), backend="pp_breakable", options=OPTIONS)
    with caplog.at_level("WARNING", logger="ppcompile"), ppcompile.counters.expect(
            fall_offs={"capture failed": 1}), CaptureHooks(on_capture=fail).injected():
        with pytest.raises(RuntimeError, match="no memory"):
            call(c, 5)
        for n in (6, 9, 12):  # eagerly from now on, and quietly
            call(c, n)
    (warning,) = _warnings(caplog, "capture failed")
    assert "no memory" in warning and "capture='lazy'" in warning
    assert list(_only(c).fall_offs()) == ["capture failed"]


def test_the_last_compile_the_recompile_limit_allows_is_announced(caplog: pytest.LogCaptureFixture) -> None:
    """Unmarked token counts recompile the frame per count (static graphs); with a limit of 2 the second
    compile warns, and the third count runs uncompiled (no backend compile, no ppcompile counter)."""
    m = Tiny()
    c = torch.compile(m, backend="pp_breakable", dynamic=False, options=OPTIONS)
    with torch._dynamo.config.patch(recompile_limit=2), caplog.at_level("WARNING", logger="ppcompile"):
        with ppcompile.counters.expect(backend_compiles=2, fall_offs={"recompile limit": 1}):
            for n in (5, 6):
                call(c, n, mark=False)
        with ppcompile.counters.expect(backend_compiles=0, replays=0, eager_runs=0):
            out = call(c, 7, mark=False)  # past the limit: Dynamo runs the frame uncompiled
    (warning,) = _warnings(caplog, "recompile limit")
    assert "Dynamo's recompile limit (2)" in warning and "mark_token_dynamic" in warning
    first, last = ppcompile.runtimes_of(c)
    assert "recompile limit" in last.fall_offs() and "recompile limit" in last.describe()
    assert "recompile budget: compile 1 of its frame, Dynamo's limit 2" in first.describe()
    budget = build_report(last)["recompile_budget"]
    reason = budget.pop("recompile_reason")
    assert budget == {"frame_compile": 2, "limit": 2, "module": 1, "recompile_of": first.name}
    assert "size mismatch at index 0. expected 5, actual 6" in reason, reason  # the unmarked count
    assert out.shape == (7, H)


def test_policy_is_no_fall_off(caplog: pytest.LogCaptureFixture) -> None:
    """Above the cap, beyond the padding guard, graph_mode='none', a 1-token static graph: documented
    policy, so no warning and no count."""
    c = torch.compile(Tiny(), backend="pp_breakable", options=OPTIONS)
    live = torch.compile(Tiny(), backend="pp_breakable", options={"graph_mode": "none"})
    with caplog.at_level("WARNING", logger="ppcompile"), ppcompile.counters.expect(fall_offs={}):
        for n in (5, 3, 20, 1):  # a bucket, beyond the guard, above the cap, one token
            call(c, n)  # marked unless one token
        call(live, 5)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_a_fall_off_is_announced_once_per_module_across_its_recompiles(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two stage graphs of one module that never graph (guards of two count classes, neither a bucket):
    one warning and one count; both list the cause."""
    m = ChunkPadder()
    c = torch.compile(m, backend="pp_breakable", options=OPTIONS)
    with caplog.at_level("WARNING", logger="ppcompile"), ppcompile.counters.expect(
            fall_offs={"never graphs": 1}):
        for n in (15, 31, 14, 30):
            call(c, n)
    graphs = [rt for rt in ppcompile.runtimes_of(m) if "never graphs" in rt.fall_offs()]
    assert len(graphs) >= 2, [rt.label for rt in ppcompile.runtimes_of(m)]
    assert len(_warnings(caplog, "never graphs")) == 1
    assert all(rt.compiled.record.module == 1 for rt in graphs)

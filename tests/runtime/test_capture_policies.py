"""``StageRuntime``'s capture policies and what a failed capture leaves (mixer stage,
``mixer_runtime.py``): order, all-at-first-call and lazy capture, capture budgets, failures injected
through the runtime's executor seam (``runtime_helpers.CaptureHooks``), and the division of labour
between ``StageRuntime`` (policy) and ``StageInstance`` (its own call and capture bookkeeping)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch
from hand_made_stage import H, call, hand_made
from mixer_runtime import (
    SIZES,
    Stage,
    check,
    compile_stage,
    graph_steps,
    inputs,
    only_state,
    symbolic_runtime,
)
from runtime_helpers import CaptureHooks, fail_at_bucket

from ppcompile import counters
from ppcompile.runtime import capture_policy, stage_runtime
from ppcompile.runtime.executors import Key
from ppcompile.runtime.stage_runtime import StageRuntime

pytestmark = pytest.mark.usefixtures("fresh_mixer")


def test_captures_largest_bucket_first() -> None:
    m = Stage()
    with CaptureHooks().injected() as hooks:
        c = compile_stage(m)
        check(c, m, 3)
    steps = graph_steps(symbolic_runtime(m))
    want = [(s, b) for b in sorted(SIZES, reverse=True) for s in steps]
    assert hooks.keys == want
    assert list(only_state(symbolic_runtime(m)).executor._captured) == want
    check(c, m, 6)
    assert len(hooks.keys) == len(want)  # no recapture


def test_capture_failure_names_segment_and_bucket_then_runs_eagerly() -> None:
    def fail_once(key: Key) -> None:
        if len(hooks.keys) == 1:
            raise MemoryError("out of graph memory (test)")

    m = Stage()
    with CaptureHooks(on_capture=fail_once).injected() as hooks:
        c = compile_stage(m)
        with pytest.raises(RuntimeError, match=r"segment submod_0 .* bucket 16 .*MemoryError"):
            c(*inputs(5))
    for i, n in enumerate([5, 8, 3, 17]):
        with counters.expect(replays=0, eager_runs=1, captures=0):
            check(c, m, n, seed=i)
    assert len(hooks.keys) == 1  # no capture retried on every call
    state = only_state(symbolic_runtime(m))
    assert state.failed is not None and "MemoryError" in state.failed
    assert not state.tables


def test_failed_capture_releases_graphs_captured_before_it() -> None:
    m = Stage()
    with CaptureHooks(on_capture=fail_at_bucket(4, message="no memory left for bucket 4 (test)")).injected():
        c = compile_stage(m)
        with pytest.raises(RuntimeError, match=r"segment submod_0 .* bucket 4"):
            c(*inputs(9))
    assert counters.captures == 4  # buckets 16 and 8 were captured before the failure
    state = only_state(symbolic_runtime(m))
    assert state.executor.num_captured() == 0  # ... and released: graphs are off for this state
    check(c, m, 9)


def test_persistent_capture_failure_leaves_runtime_usable() -> None:
    def always_fail(key: Key) -> None:
        raise RuntimeError("capture not possible (test)")

    m = Stage()
    with CaptureHooks(on_capture=always_fail).injected():
        c = compile_stage(m)
        with pytest.raises(RuntimeError, match="bucket 16"):
            c(*inputs(5))
        for i, n in enumerate([5, 9, 2]):
            check(c, m, n, seed=i)


def test_capture_runs_each_graph_segment_once() -> None:
    """Smaller buckets view the largest bucket's outputs: capture costs one run per segment."""
    calls: list[int] = []

    def counting(key: Key, fn: Any) -> Any:
        def run(*args: Any) -> Any:
            calls.append(key[0])
            return fn(*args)
        return run

    m = Stage()
    with CaptureHooks(segment=counting).injected():
        c = compile_stage(m)
        with counters.expect(captures=2 * len(SIZES), replays=1):
            check(c, m, 5)
    assert sorted(calls) == sorted(graph_steps(symbolic_runtime(m)) * 2)  # one capture run + one replay each


# ----------------------------------------------------------------------------------------- capture policies
@pytest.mark.parametrize("graph_mode", ["emulate", "eager"])
def test_lazy_capture_captures_a_bucket_at_its_first_use(graph_mode: str) -> None:
    m = Stage()
    c = compile_stage(m, capture="lazy", graph_mode=graph_mode)
    with counters.expect(captures=2, replays=1):  # two graph segments, one bucket
        check(c, m, 6)
    rt = symbolic_runtime(m)
    assert rt.captured_buckets() == {0: (8,)}
    for n, new in ((7, 0), (3, 2), (12, 2), (5, 0), (16, 0), (2, 0)):  # buckets 8, 4, 16, 8, 16, 4
        with counters.expect(captures=new, replays=1):
            check(c, m, n)
    assert rt.captured_buckets() == {0: (4, 8, 16)}


def test_a_capture_budget_spends_on_the_most_served_buckets_first() -> None:
    from ppcompile.planning.traffic import process_histogram

    m = Stage()
    c = compile_stage(m, capture="lazy", capture_budget_s=60.0)
    with counters.expect(captures=6):  # the whole ladder fits the budget
        check(c, m, 6)
    assert symbolic_runtime(m).captured_buckets() == {0: (4, 8, 16)}
    traffic = process_histogram()
    saved = traffic.copy()
    traffic.reset()
    try:
        for n in [3] * 10 + [12] * 2:  # bucket 4 serves 30 tokens, bucket 16 serves 24
            traffic.record(n)
        assert symbolic_runtime(m).bucket_values() == [4, 16, 8]
    finally:
        traffic.reset()
        traffic.merge(saved)


def test_a_tiny_capture_budget_captures_the_needed_bucket_only() -> None:
    m = Stage()
    c = compile_stage(m, capture="lazy", capture_budget_s=1e-9)
    with counters.expect(captures=2):
        check(c, m, 6)
    assert symbolic_runtime(m).captured_buckets() == {0: (8,)}


def test_a_failed_lazy_capture_leaves_the_other_buckets_serving(caplog: pytest.LogCaptureFixture) -> None:
    m = Stage()
    with CaptureHooks().injected() as hooks:
        c = compile_stage(m, capture="lazy")
        check(c, m, 6)
    hooks.on_capture = fail_at_bucket(16)  # armed after the first capture: the runtime keeps its executor
    for _ in range(2):
        with counters.expect(replays=0, eager_runs=1):
            check(c, m, 12)
    with counters.expect(replays=1, eager_runs=0):
        check(c, m, 7)
    warnings = [r for r in caplog.records if "capture of bucket 16 failed" in r.getMessage()]
    assert len(warnings) == 1 and "no memory for bucket 16" in warnings[0].getMessage()
    assert "bucket capture failed" in warnings[0].getMessage()  # the cause, named
    assert symbolic_runtime(m).captured_buckets() == {0: (8,)}
    assert list(symbolic_runtime(m).fall_offs()) == ["bucket capture failed"]
    assert counters.fall_offs == {"bucket capture failed": 1}


def test_a_budgeted_capture_failing_at_another_bucket_keeps_the_requested_one() -> None:
    """A capture budget captures the needed bucket, then others: when a later one fails, only that one
    runs eagerly; the needed bucket, captured fine, replays (it was marked failed and forgotten while
    its table stayed)."""
    m = Stage()
    with CaptureHooks(on_capture=fail_at_bucket(16)).injected():
        c = compile_stage(m, capture="lazy", capture_budget_s=60.0)
        with counters.expect(replays=1, eager_runs=0, fall_offs={"bucket capture failed": 1}):
            check(c, m, 6)  # bucket 8 first, then the budget goes on to 16 (fails) and 4
    for n, replays in ((7, 1), (12, 0), (3, 1)):
        with counters.expect(replays=replays, eager_runs=1 - replays):
            check(c, m, n)
    (state,) = symbolic_runtime(m).instances()
    assert 8 in state.captured_buckets and 16 not in state.captured_buckets
    assert list(state.failed_buckets) == [16]


# ----------------------------------------------------------------------------------------- who does what
def test_the_runtime_assigns_no_attribute_of_a_stage_instance() -> None:
    """``StageRuntime`` keeps policy; a call's state (lock, aliasing, owned copies, stale outputs, capture
    failures) belongs to ``StageInstance``: ``stage_runtime.py`` and its capture policy assign attributes
    of ``self`` only (``state.owner = ...`` or ``setattr(state, ...)`` would put the ping-pong back), and
    of what they import (``counters.eager_runs += 1``)."""
    for module in (stage_runtime, capture_policy):
        _assert_assigns_only_its_own(Path(module.__file__).read_text())


def _assert_assigns_only_its_own(source: str) -> None:
    tree = ast.parse(source)
    imported = {a.asname or a.name for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
                for a in node.names}
    foreign = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        attributes = [t for target in targets for t in ast.walk(target) if isinstance(t, ast.Attribute)]
        foreign += [f"line {t.lineno}: {ast.unparse(t)}" for t in attributes
                    if not (isinstance(t.value, ast.Name) and t.value.id in {"self", *imported})]
        called = node.func if isinstance(node, ast.Call) else None
        if isinstance(called, ast.Name) and called.id in ("setattr", "delattr"):
            foreign.append(f"line {node.lineno}: {ast.unparse(node)}")
    assert not foreign, foreign


def test_a_runtime_built_by_hand_takes_its_executor_by_argument() -> None:
    hooks = CaptureHooks()
    runtime = StageRuntime(*hand_made("emulate"), executor=hooks.factory)
    got, want = call(runtime, 5, torch.randn(H, H), seed=0)
    torch.testing.assert_close(got, want)
    assert runtime.instances()[0].executor is hooks.executors[0] and len(hooks.keys) == 2 * 3
    with pytest.raises(RuntimeError, match="before the first call that captures"):
        runtime.use_executor(hooks.factory)  # an instance exists: its executor is not swapped under it

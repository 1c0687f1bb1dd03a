"""Tests of ``ppcompile.counters``: ``expect`` deltas, ``replays_by_bucket``, ``reset``."""

from __future__ import annotations

import pytest

import ppcompile
from ppcompile.counters import Counters, counters


def test_package_exports_the_process_wide_counters() -> None:
    assert ppcompile.counters is counters
    assert counters.snapshot() == {"replays": 0, "whole_replays": 0, "eager_runs": 0, "captures": 0,
                                   "backend_compiles": 0, "segment_compiles": 0, "segment_cache_hits": 0,
                                   "eager_code_reuses": 0,
                                   "input_recompiles": 0, "token_count_mismatches": 0,
                                   "replays_by_bucket": {},
                                   "fall_offs": {}, "fence_waits": {}}


def test_expect_passes_on_exact_deltas() -> None:
    c = Counters(replays=5)
    with c.expect(replays=2, captures=1, eager_runs=0):
        c.replays += 2
        c.captures += 1


def test_expect_fails_on_wrong_delta_with_a_clear_message() -> None:
    c = Counters()
    with pytest.raises(AssertionError, match=r"replays: expected change 2, got 1"), c.expect(replays=2):
        c.replays += 1


def test_expect_reports_every_wrong_counter() -> None:
    c = Counters()
    with pytest.raises(AssertionError) as info, c.expect(replays=1, eager_runs=1):
        c.captures += 1
    assert "replays: expected change 1, got 0" in str(info.value)
    assert "eager_runs: expected change 1, got 0" in str(info.value)


def test_unnamed_counters_may_change() -> None:
    c = Counters()
    with c.expect(replays=1):
        c.replays += 1
        c.captures += 3


def test_replays_by_bucket_deltas() -> None:
    c = Counters()
    c.replays_by_bucket[16] += 4
    with c.expect(replays_by_bucket={16: 1, 32: 2, 64: 0}):
        c.replays_by_bucket[16] += 1
        c.replays_by_bucket[32] += 2
    with pytest.raises(AssertionError, match="replays_by_bucket"), c.expect(replays_by_bucket={16: 1}):
        c.replays_by_bucket[16] += 1
        c.replays_by_bucket[8] += 1  # a bucket not named must not change
    with pytest.raises(AssertionError, match="replays_by_bucket"), c.expect(replays_by_bucket={16: 2}):
        c.replays_by_bucket[16] += 1
    with c.expect(replays_by_bucket={}):
        pass


def test_unknown_counter_names_are_rejected() -> None:
    expect = counters.expect(replay=1)
    with pytest.raises(ValueError, match=r"unknown counter\(s\) \['replay'\]") as info, expect:
        pass
    assert "replays_by_bucket" in str(info.value)


def test_reset_zeroes_everything_and_keeps_the_bucket_counter() -> None:
    c = Counters(replays=3, eager_runs=2, captures=1, backend_compiles=4)
    buckets = c.replays_by_bucket
    buckets[8] += 3
    c.reset()
    assert c.snapshot() == Counters().snapshot()
    assert c.replays_by_bucket is buckets and not buckets


def test_snapshot_is_a_copy() -> None:
    c = Counters()
    snap = c.snapshot()
    c.replays += 1
    c.replays_by_bucket[4] += 1
    assert snap["replays"] == 0 and snap["replays_by_bucket"] == {}


def test_autouse_fixture_resets_between_tests_part_1() -> None:
    counters.replays += 7
    counters.replays_by_bucket[2] += 1


def test_autouse_fixture_resets_between_tests_part_2() -> None:
    assert counters.replays == 0 and counters.replays_by_bucket == {}

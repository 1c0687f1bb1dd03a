"""Tests of the token buckets: the default ladder, explicit sizes, the O(1) table and eager fallback."""

from __future__ import annotations

import bisect
import itertools
import random

import pytest

from ppcompile.config import PPBreakableConfig
from ppcompile.runtime.buckets import default_capture_ladder, make_bucket_plan


def _plan(**options):  # type: ignore[no-untyped-def]
    return make_bucket_plan(PPBreakableConfig.from_options(options))


def test_default_ladder_shape() -> None:
    ladder = default_capture_ladder(8192)
    assert ladder[:4] == (1, 2, 4, 8)
    assert ladder[:10] == (1, 2, 4, 8, 12, 16, 20, 24, 28, 32)
    assert ladder[10:13] == (36, 40, 44)
    assert all(a < b for a, b in itertools.pairwise(ladder))
    assert ladder[-1] == 8192 and ladder[-2] == 7680
    assert len(ladder) == 74
    assert _plan().sizes == ladder


@pytest.mark.parametrize("cap", [1, 2, 3, 5, 31, 32, 33, 100, 1000, 4096, 5000])
def test_ladder_ends_at_the_cap(cap: int) -> None:
    ladder = default_capture_ladder(cap)
    assert ladder[-1] == cap
    assert all(a < b for a, b in itertools.pairwise(ladder))
    assert set(ladder[:-1]) <= set(default_capture_ladder(8192))  # off-grid caps are appended


def test_cap_1000_appends_the_cap() -> None:
    assert default_capture_ladder(1000)[-3:] == (896, 960, 1000)


def test_bad_cap() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        default_capture_ladder(0)


def test_padding_waste_bounded_above_32() -> None:
    plan = _plan()
    for n in range(33, 8193):
        b = plan.bucket(n)
        assert b is not None and b >= n
        assert (b - n) / n < 0.125, n


def test_explicit_capture_sizes_override_the_ladder() -> None:
    plan = _plan(capture_sizes=[32, 16, 64], max_capture_tokens=8192)
    assert plan.sizes == (16, 32, 64) and plan.cap == 64
    assert [plan.bucket(n) for n in (8, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]
    assert plan.bucket(65) is None


def test_bucket_table_equals_brute_force() -> None:
    rng = random.Random(0)
    for options in ({}, {"capture_sizes": [3, 17, 100, 1000]}, {"max_capture_tokens": 1000,
                                                                "max_padding_factor": 1.25}):
        plan = _plan(**options)
        for n in [*rng.sample(range(-5, plan.cap + 50), 400), 0, 1, plan.cap, plan.cap + 1]:
            i = bisect.bisect_left(plan.sizes, n)
            want = plan.sizes[i] if n >= 1 and i < len(plan.sizes) else None
            if want is not None and want > plan.max_padding_factor * n:
                want = None
            assert plan.bucket(n) == want, (options, n)
            assert (plan.eager_reason(n) is None) == (want is not None)


def test_eager_above_the_cap_with_a_reason() -> None:
    plan = _plan(max_capture_tokens=1000)
    assert plan.bucket(1000) == 1000
    assert plan.bucket(1001) is None
    reason = plan.eager_reason(1001)
    assert reason is not None and "1001" in reason and "cap 1000" in reason
    assert plan.eager_reason(1000) is None


def test_eager_beyond_the_padding_factor_with_a_reason() -> None:
    plan = _plan(capture_sizes=[16, 32], max_padding_factor=2.0)
    assert plan.bucket(8) == 16  # exactly 2x
    assert plan.bucket(7) is None
    reason = plan.eager_reason(7)
    assert reason is not None and "bucket 16" in reason and "max_padding_factor=2" in reason
    assert plan.bucket(17) == 32 and plan.eager_reason(17) is None


def test_no_tokens_runs_eagerly() -> None:
    plan = _plan()
    assert plan.bucket(0) is None and plan.eager_reason(0) is not None


def test_padding_table() -> None:
    plan = _plan(capture_sizes=[4, 8])
    assert plan.padding_table() == [
        (1, None, 0.0), (2, 4, 1.0), (3, 4, 1 / 3), (4, 4, 0.0), (5, 8, 0.6), (6, 8, 1 / 3), (7, 8, 1 / 7),
        (8, 8, 0.0),
    ]


def test_sizes_the_graph_was_not_traced_for_are_refused() -> None:
    """A graph Dynamo traced under ``n % 8 == 7`` (its sizes simplified for such counts) is captured only
    at buckets where that holds; counts another bucket would have served go to the next admitted one
    (within the padding factor) or run eagerly, with the reason."""
    config = PPBreakableConfig.from_options({"capture_sizes": [8, 15, 16, 23, 32]})
    plan = make_bucket_plan(config, admits=lambda size: size % 8 == 7)
    assert plan.sizes == (15, 23) and plan.refused == (8, 16, 32)
    assert [plan.bucket(n) for n in (7, 8, 15, 16, 23, 24)] == [None, 15, 15, 23, 23, None]
    assert "traced for" in str(plan.eager_reason(7)) and "traced for" in str(plan.eager_reason(24))
    none = make_bucket_plan(config, admits=lambda size: False)
    assert none.sizes == () and none.cap == 0 and none.bucket(8) is None

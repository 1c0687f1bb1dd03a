"""``plan_buckets`` against brute force over every ladder, and against a plain O(K N^2) dynamic
programme on larger histograms; ``evaluate_ladder`` against the runtime's own bucket plan."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ppcompile
from ppcompile.config import PPBreakableConfig
from ppcompile.planning.planner import DEFAULT_GRAPH_GAIN_TOKENS, LadderPlan, evaluate_ladder, plan_buckets
from ppcompile.planning.traffic import TokenHistogram
from ppcompile.runtime.buckets import make_bucket_plan

factors = st.one_of(st.sampled_from([1.0, 1.25, 1.5, 2.0, 3.0]), st.floats(1.0, 4.0))
# multiples of 1/64 (used exactly), small ones, and one above any padding
gains = st.one_of(st.sampled_from([0, 2.5, 10**6]), st.integers(0, 30))


def _cost(counts: dict[int, int], ladder: tuple[int, ...], f: float, gain: Fraction) -> Fraction:
    """The issue's cost, written out directly."""
    total = Fraction(0)
    for n, c in counts.items():
        b = next((s for s in ladder if s >= n), None)
        if b is not None and b <= f * n:
            total += c * (b - n - gain)
    return total


def _brute_force(counts: dict[int, int], k: int, cap: int, f: float, gain: Fraction) -> tuple[int, ...]:
    """Every ladder of at most k sizes in 1..cap (sizes beyond the largest count + 2 serve nothing new);
    the least (cost, buckets, sizes from the largest down)."""
    top = min(cap, max(counts) + 2)
    ladders = (s for size in range(k + 1) for s in itertools.combinations(range(1, top + 1), size))
    return min(ladders, key=lambda s: (_cost(counts, s, f, gain), len(s), s[::-1]))


@settings(max_examples=150, deadline=None)
@given(
    counts=st.dictionaries(st.integers(1, 10), st.integers(1, 20), min_size=1, max_size=7),
    k=st.integers(1, 4),
    cap=st.one_of(st.none(), st.integers(1, 12)),
    f=factors,
    gain=gains,
)
def test_plan_matches_brute_force(counts: dict[int, int], k: int, cap: int | None, f: float,
                                  gain: float) -> None:
    plan = plan_buckets(counts, k, cap=cap, max_padding_factor=f, graph_gain_tokens=gain)
    best = _brute_force(counts, k, cap or 8192, f, Fraction(gain))
    assert plan.capture_sizes == best
    assert plan.cost == float(_cost(counts, best, f, Fraction(gain)))


def _plain_dp(counts: dict[int, int], k: int, cap: int, f: float, gain: int) -> tuple[int, ...]:
    """O(K N^2) over the distinct counts with the same tie rule, each step summed from prefix sums."""
    xs = [n for n in sorted(counts) if n <= cap]
    hs = [counts[n] for n in xs]
    hp, wp = list(itertools.accumulate([0, *hs])), list(itertools.accumulate([0, *(x * h for x, h in
                                                                                  zip(xs, hs))]))

    # eager[j]: the counts xs[:eager[j]] are too small for bucket xs[j-1]
    eager = [0] + [sum(1 for x in xs if b > f * x) for b in xs]

    def step(i: int, j: int) -> tuple[int, int]:  # bucket xs[j-1] right after xs[i-1] (i = 0: none)
        low = max(i, eager[j])
        return (xs[j - 1] - gain) * (hp[j] - hp[low]) - (wp[j] - wp[low]), 1

    n = len(xs)
    value = [(0, 0)] + [step(0, j) for j in range(1, n + 1)]
    parents = [[0] * (n + 1)]
    for _ in range(2, min(k, n) + 1):
        new, parent = [(0, 0)], [0]
        for j in range(1, n + 1):
            options = [((value[i][0] + step(i, j)[0], value[i][1] + 1), i) for i in range(j)]
            best = min(options)
            new.append(best[0])
            parent.append(best[1])
        value = new
        parents.append(parent)
    j = min(range(n + 1), key=lambda j: (value[j], j))
    ladder = []
    for parent in reversed(parents):
        if j == 0:
            break
        ladder.append(xs[j - 1])
        j = parent[j]
    return tuple(reversed(ladder))


@settings(max_examples=40, deadline=None)
@given(
    counts=st.dictionaries(st.integers(1, 400), st.sampled_from([1, 2, 3, 50, 1000]), min_size=5,
                           max_size=40),
    k=st.integers(1, 8),
    cap=st.integers(1, 400),
    f=factors,
    gain=st.sampled_from([0, 3, 40, 400, 10**6]),
)
def test_plan_matches_a_plain_dynamic_programme(counts: dict[int, int], k: int, cap: int, f: float,
                                                gain: int) -> None:
    plan = plan_buckets(counts, k, cap=cap, max_padding_factor=f, graph_gain_tokens=gain)
    assert plan.capture_sizes == _plain_dp(counts, k, cap, f, gain)


def test_dense_counts_use_every_bucket_and_stay_optimal() -> None:
    counts = {n: 1 + (n * 7919) % 13 for n in range(1, 301)}
    plan = plan_buckets(counts, 12, cap=300, graph_gain_tokens=50)
    assert len(plan.capture_sizes) == 12 and plan.capture_sizes == _plain_dp(counts, 12, 300, 2.0, 50)
    assert plan.cost < plan_buckets(counts, 11, cap=300, graph_gain_tokens=50).cost


@settings(max_examples=40, deadline=None)
@given(
    counts=st.dictionaries(st.integers(1, 200), st.integers(1, 9), min_size=1, max_size=30),
    ladder=st.lists(st.integers(1, 220), min_size=1, max_size=8),
    f=factors,
)
def test_evaluate_ladder_follows_the_runtime_bucket_plan(counts: dict[int, int], ladder: list[int],
                                                         f: float) -> None:
    plan = evaluate_ladder(counts, ladder, max_padding_factor=f, graph_gain_tokens=3)
    runtime = make_bucket_plan(PPBreakableConfig(capture_sizes=tuple(ladder), max_padding_factor=f))
    served = {n: runtime.bucket(n) or 0 for n in counts}
    assert plan.graphed_forwards == sum(c for n, c in counts.items() if served[n])
    assert plan.padded_tokens == sum(c * (served[n] - n) for n, c in counts.items() if served[n])
    assert plan.served_tokens == sum(c * n for n, c in counts.items() if served[n])
    assert plan.cost == plan.padded_tokens - 3 * plan.graphed_forwards
    assert plan.total_forwards == sum(counts.values())


def test_plan_fields_and_options() -> None:
    plan = plan_buckets({2048: 90, 1000: 10, 20000: 5}, 4)
    assert isinstance(plan, LadderPlan) and ppcompile.plan_buckets is plan_buckets
    assert plan.capture_sizes == (1000, 2048)  # 20000 is above the default cap 8192: eager
    assert plan.graphed_forwards == 100 and plan.total_forwards == 105
    assert plan.graphed_fraction == pytest.approx(100 / 105)
    assert plan.padded_tokens == 0 and plan.padding_per_served_token == 0.0
    assert plan.cost == -100 * DEFAULT_GRAPH_GAIN_TOKENS
    assert plan.options() == {"capture_sizes": [1000, 2048]}
    PPBreakableConfig.from_options(plan.options())
    wide = plan_buckets({10: 1, 15: 1}, 1, max_padding_factor=3.0)
    assert wide.options() == {"capture_sizes": [15], "max_padding_factor": 3.0}


def test_without_a_gain_every_graph_costs_so_the_ladder_is_empty() -> None:
    plan = plan_buckets({5: 3, 9: 2}, 4, graph_gain_tokens=0)
    assert plan.capture_sizes == () and plan.cost == 0.0 and plan.graphed_fraction == 0.0
    assert plan.options() == {"graph_mode": "none"}
    PPBreakableConfig.from_options(plan.options())


def test_a_count_may_be_left_eager_on_purpose() -> None:
    # 1 forward of 60 tokens would pad 40 under bucket 100 (gain 10): a bucket of its own is better
    # spent on the 100s; with one bucket, 60 runs eagerly.
    plan = plan_buckets({60: 1, 100: 50}, 1, graph_gain_tokens=10)
    assert plan.capture_sizes == (100,) and plan.graphed_forwards == 51
    plan = plan_buckets({60: 1, 100: 50}, 1, graph_gain_tokens=10, max_padding_factor=1.5)
    assert plan.capture_sizes == (100,) and plan.graphed_forwards == 50  # 100 > 1.5 * 60: eager
    assert plan_buckets({60: 1, 100: 50}, 1, graph_gain_tokens=50).graphed_forwards == 51


def test_ties_go_to_fewer_buckets_then_to_the_smaller_largest_bucket() -> None:
    # {2: 1, 4: 1}, gain 2, one bucket: [2] costs -2 (4 eager), [4] costs (2 - 2) + (0 - 2) = -2
    assert plan_buckets({2: 1, 4: 1}, 1, graph_gain_tokens=2).capture_sizes == (2,)
    # gain 0: [], [2] and [2, 4] all cost 0
    assert plan_buckets({2: 1, 4: 1}, 2, graph_gain_tokens=0).capture_sizes == ()
    # the same histogram gives the same ladder, whatever the order of its entries
    assert plan_buckets({4: 1, 2: 1}, 1, graph_gain_tokens=2).capture_sizes == (2,)


def test_histogram_and_mapping_plan_alike() -> None:
    hist = TokenHistogram()
    for n in [7, 7, 12, 300, 300, 300, 4096, 5000]:
        hist.record(n)
    assert plan_buckets(hist, 3, graph_gain_tokens=100) == plan_buckets(hist.counts(), 3,
                                                                       graph_gain_tokens=100)


def test_cap_bounds_the_ladder() -> None:
    plan = plan_buckets({100: 5, 200: 5, 300: 5}, 3, cap=250)
    assert plan.capture_sizes == (100, 200) and plan.graphed_forwards == 10
    assert plan_buckets({300: 5}, 3, cap=250).capture_sizes == ()


def test_fractional_gain_is_used_to_a_64th_of_a_token() -> None:
    plan = plan_buckets({4: 1}, 1, graph_gain_tokens=0.1)
    assert plan.graph_gain_tokens == 6 / 64 and plan.cost == -6 / 64


@pytest.mark.parametrize(("kwargs", "problem"), [
    ({"max_buckets": 0}, "max_buckets must be an int >= 1"),
    ({"max_buckets": True}, "max_buckets must be an int >= 1"),
    ({"cap": 0}, "cap must be an int >= 1 or None"),
    ({"cap": 8.5}, "cap must be an int >= 1 or None"),
    ({"max_padding_factor": 0.5}, "max_padding_factor must be a finite number >= 1.0"),
    ({"max_padding_factor": float("nan")}, "max_padding_factor must be"),
    ({"graph_gain_tokens": -1}, "graph_gain_tokens must be a finite number >= 0"),
    ({"graph_gain_tokens": float("inf")}, "graph_gain_tokens must be"),
    ({"histogram": [1, 2]}, "histogram must be a TokenHistogram or a mapping"),
    ({"histogram": {0: 1}}, "token counts must be ints >= 1, got key 0"),
    ({"histogram": {"8": 1}}, "token counts must be ints >= 1"),
    ({"histogram": {8: -1}}, "forwards must be ints >= 0, got -1 for 8 tokens"),
    ({"histogram": {8: 0.5}}, "forwards must be ints >= 0"),
    ({"histogram": {8192: 2**50}}, "too many for exact int64 costs"),
])
def test_bad_arguments_are_named(kwargs: dict[str, object], problem: str) -> None:
    args: dict[str, object] = {"histogram": {4: 1}, "max_buckets": 2, **kwargs}
    with pytest.raises(ValueError, match=problem):
        plan_buckets(**args)  # type: ignore[arg-type]


def test_empty_histogram_plans_nothing() -> None:
    plan = plan_buckets({}, 4)
    assert plan.capture_sizes == () and plan.total_forwards == 0 and plan.graphed_fraction == 0.0
    assert plan_buckets({4: 0}, 4).capture_sizes == ()

"""Bucket ladders planned from recorded traffic: ``plan_buckets``, and ``evaluate_ladder`` for any ladder.

**Cost.** For a ladder S and a histogram h of live token counts n, a forward of n tokens is served by a
graph iff the smallest bucket b >= n in S exists and b <= ``max_padding_factor`` * n (the runtime's own
rule, ``runtime/buckets.py``); it then costs (b - n) - ``graph_gain_tokens`` (padding computed, minus what
a replay saves over eager, in tokens of compute); a forward that runs eagerly costs 0.
cost(S) = sum_n h(n) * cost(n). ``plan_buckets`` returns a ladder of minimal cost with at most
``max_buckets`` sizes in 1..cap; among ladders of equal cost the one with the fewest buckets, then the
one whose largest bucket is smallest, then the next largest, and so on (fully deterministic).

**Why observed counts suffice.** A bucket b serves the counts in (previous bucket, b] with b <= f * n.
Lowering b to the largest observed count <= b (dropping it when there is none above the previous bucket)
serves the same forwards with less padding and admits no new eager ones, so some minimal ladder uses
observed counts (clipped to the cap) only, and the tie rule above prefers it.

**Algorithm.** Dynamic programming over the N distinct counts x_1 < ... < x_N <= cap, one layer per
bucket: F_k[j] = least cost of at most k buckets, the largest being x_j, over the counts <= x_j.
Bucket x_j after bucket x_i serves counts in (x_i, x_j] at or above x_j / f; those below, up to index
L_j, run eagerly. For i <= L_j the step costs the same for every i (a prefix minimum); for
L_j < i < j it is D(i, j) = sum_{i<t<=j} h_t (x_j - x_t - g), O(1) from prefix sums of h and h*x. D is
Monge (D(a,c) + D(b,d) - D(a,d) - D(b,c) = -(H_b - H_a)(x_d - x_c) <= 0) and the band L_j < i < j has
both edges nondecreasing in j, so the leftmost optimal i is nondecreasing in j: each layer is solved by
divide and conquer in O(N log N), vectorised level by level with torch. Layers stop early once another
bucket no longer helps. Costs are exact int64 arithmetic (``graph_gain_tokens`` is used to 1/64 token).

**Default gain.** ``DEFAULT_GRAPH_GAIN_TOKENS`` = 3900 comes from the seed's measurements at 2048-token
forwards (figures and arithmetic in ``docs/benchmarks.md``, "Bucket planning"): the wall time graphs save
per forward in the unprofiled 2K throughput run, divided by the kernel time per token of the busiest
stage in its stage profile, rounded down. It is a constant-overhead model, valid while forwards are
launch-bound: up to the 8192 cap, where the seed measured graphs ahead (above it they lost), hence the
default cap.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import torch

from ppcompile.config import DEFAULT_MAX_CAPTURE_TOKENS, PPBreakableConfig
from ppcompile.planning.traffic import TokenHistogram

__all__ = ["DEFAULT_GRAPH_GAIN_TOKENS", "LadderPlan", "evaluate_ladder", "plan_buckets"]

DEFAULT_GRAPH_GAIN_TOKENS = 3900
"""Tokens of stage compute a graph replay saves per forward (from the seed's figures; module docstring)."""

_GAIN_QUANTUM = 64  # a fractional graph_gain_tokens is used to the nearest 1/64 token
_INT64_SAFE = 1 << 61  # the DP's int64 keys must stay below this


@dataclasses.dataclass(frozen=True)
class LadderPlan:
    """A bucket ladder scored on a histogram (from ``plan_buckets`` or ``evaluate_ladder``).

    ``cost`` = ``padded_tokens`` - ``graph_gain_tokens`` * ``graphed_forwards``. ``served_tokens`` are the
    live tokens of graphed forwards; ``padded_tokens`` the tokens they computed beyond them.
    """

    capture_sizes: tuple[int, ...]
    cost: float
    padded_tokens: int
    served_tokens: int
    graphed_forwards: int
    total_forwards: int
    total_tokens: int
    max_padding_factor: float
    graph_gain_tokens: float

    @property
    def graphed_fraction(self) -> float:
        """Forwards served by a graph, as a fraction of all forwards (0 for an empty histogram)."""
        return self.graphed_forwards / self.total_forwards if self.total_forwards else 0.0

    @property
    def padding_per_served_token(self) -> float:
        """Padded tokens computed per live token served by a graph (0 when nothing is graphed)."""
        return self.padded_tokens / self.served_tokens if self.served_tokens else 0.0

    def options(self) -> dict[str, Any]:
        """The ``torch.compile(..., options=...)`` entries that apply this ladder (``max_padding_factor``
        too when it is not the runtime's default). An empty ladder (every forward eager) is
        ``graph_mode="none"``: no buckets, segments at the live size."""
        if not self.capture_sizes:
            return {"graph_mode": "none"}
        options: dict[str, Any] = {"capture_sizes": list(self.capture_sizes)}
        if self.max_padding_factor != PPBreakableConfig.max_padding_factor:
            options["max_padding_factor"] = self.max_padding_factor
        return options


def evaluate_ladder(
    histogram: TokenHistogram | Mapping[int, int],
    capture_sizes: Sequence[int],
    *,
    max_padding_factor: float = 2.0,
    graph_gain_tokens: float = DEFAULT_GRAPH_GAIN_TOKENS,
) -> LadderPlan:
    """Scores ``capture_sizes`` on ``histogram`` with the runtime's serving rule (module docstring)."""
    sizes = list(capture_sizes)
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"evaluate_ladder: capture_sizes must be positive ints, got {sizes}")
    return _evaluate(_counts(histogram), sizes, _padding_factor(max_padding_factor), _gain(graph_gain_tokens))


def _evaluate(counts: dict[int, int], capture_sizes: Sequence[int], f: float, gain: Fraction) -> LadderPlan:
    sizes = sorted(set(capture_sizes))
    padded = served = graphed = 0
    for n, c in counts.items():
        i = bisect.bisect_left(sizes, n)
        if i < len(sizes) and sizes[i] <= f * n:
            padded += c * (sizes[i] - n)
            served += c * n
            graphed += c
    return LadderPlan(
        capture_sizes=tuple(sizes),
        cost=float(padded - gain * graphed),
        padded_tokens=padded,
        served_tokens=served,
        graphed_forwards=graphed,
        total_forwards=sum(counts.values()),
        total_tokens=sum(n * c for n, c in counts.items()),
        max_padding_factor=f,
        graph_gain_tokens=float(gain),
    )


def plan_buckets(
    histogram: TokenHistogram | Mapping[int, int],
    max_buckets: int,
    *,
    cap: int | None = None,
    max_padding_factor: float = 2.0,
    graph_gain_tokens: float = DEFAULT_GRAPH_GAIN_TOKENS,
) -> LadderPlan:
    """The ladder of at most ``max_buckets`` sizes in 1..``cap`` of minimal cost on ``histogram`` (a
    ``TokenHistogram`` or ``{token count: forwards}``); exact, ties broken as the module docstring says.

    ``cap`` None means the runtime's default cap (8192): beyond it the seed measured graphs slower than
    eager, so the constant gain of the cost model does not hold there. Counts above the cap run eagerly.
    """
    counts = _counts(histogram)
    if isinstance(max_buckets, bool) or not isinstance(max_buckets, int) or max_buckets < 1:
        raise ValueError(f"plan_buckets: max_buckets must be an int >= 1, got {max_buckets!r}")
    if cap is None:
        cap = DEFAULT_MAX_CAPTURE_TOKENS
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ValueError(f"plan_buckets: cap must be an int >= 1 or None, got {cap!r}")
    f = _padding_factor(max_padding_factor)
    gain = _gain(graph_gain_tokens)
    xs = [n for n in counts if n <= cap]
    sizes = _solve(xs, [counts[n] for n in xs], max_buckets, f, gain) if xs else ()
    return _evaluate(counts, sizes, f, gain)


def _counts(histogram: TokenHistogram | Mapping[int, int]) -> dict[int, int]:
    """``{count: forwards}``, ascending, without zero entries; validated."""
    if isinstance(histogram, TokenHistogram):
        return histogram.counts()
    if not isinstance(histogram, Mapping):
        raise ValueError("histogram must be a TokenHistogram or a mapping {token count: forwards}, got "
                         f"{type(histogram).__name__}")
    out = {}
    for n, c in histogram.items():
        if not (type(n) is int or _is_integer(n)) or n < 1:
            raise ValueError(f"histogram: token counts must be ints >= 1, got key {n!r}")
        if not (type(c) is int or _is_integer(c)) or c < 0:
            raise ValueError(f"histogram: forwards must be ints >= 0, got {c!r} for {n} tokens")
        if c:
            out[int(n)] = int(c)
    return dict(sorted(out.items()))


def _is_integer(value: object) -> bool:
    """An integer that is not a bool (numpy and torch integer scalars included)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _padding_factor(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1.0 <= value < math.inf:
        raise ValueError(f"max_padding_factor must be a finite number >= 1.0, got {value!r}")
    return float(value)


def _gain(value: float) -> Fraction:
    """``graph_gain_tokens`` as used: exact when integral, else to the nearest 1/64 token."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"graph_gain_tokens must be a finite number >= 0, got {value!r}")
    exact = Fraction(value)
    return exact if exact.denominator == 1 else Fraction(round(exact * _GAIN_QUANTUM), _GAIN_QUANTUM)


def _solve(xs: list[int], hs: list[int], max_buckets: int, f: float, gain: Fraction) -> tuple[int, ...]:
    """The minimal ladder over distinct counts ``xs`` (ascending) with forwards ``hs``."""
    n = len(xs)
    k_max = min(max_buckets, n)
    unit = gain.denominator  # costs in 1/unit tokens: integral
    total_forwards = sum(hs)
    # A gain above any ladder's padding only ranks ladders by forwards graphed, then by padding: the same
    # order as a gain of (padding bound + 1), which keeps the int64 keys small.
    g = min(int(gain * unit), unit * xs[-1] * total_forwards + 1)
    scale = k_max + 1  # key = cost * scale + buckets: fewest buckets among equal costs
    bound = scale * 2 * (2 * unit * xs[-1] + g) * total_forwards + scale
    if bound >= _INT64_SAFE:
        raise ValueError(f"plan_buckets: {total_forwards} forwards are too many for exact int64 costs; "
                         "divide the histogram's counts by a common factor (the plan depends on ratios)")
    dp = _Steps.build(xs, hs, f, unit, g, scale)
    value = dp.after_prefix(torch.zeros(n + 1, dtype=torch.int64))  # one bucket, nothing before it
    value[0] = 0
    choices = [torch.zeros(n + 1, dtype=torch.int64)]
    for _ in range(2, k_max + 1):
        new_value, choice = dp.layer(value)
        if torch.equal(new_value, value):
            break  # another bucket helps no prefix: nor will any further one
        value = new_value
        choices.append(choice)
    j = int(torch.argmin(value))  # first minimum: index 0 (empty ladder) or the smallest largest bucket
    ladder: list[int] = []
    for choice in reversed(choices):
        if j == 0:
            break
        ladder.append(xs[j - 1])
        j = int(choice[j])
    return tuple(reversed(ladder))


@dataclasses.dataclass(frozen=True)
class _Steps:
    """The DP's step keys, split into row and column terms. With a_j = unit * x_j - g and prefix sums
    hp (forwards) and wp (tokens), bucket x_j right after bucket x_i (i >= L_j; index 0: no bucket) has
    key scale * D(i, j) + 1 = r_i - a_j * q_i + column_j."""

    a: torch.Tensor  # per column j
    column: torch.Tensor  # per column j: scale * (a_j * hp_j - unit * wp_j) + 1
    q: torch.Tensor  # per row i: scale * hp_i
    r: torch.Tensor  # per row i: scale * unit * wp_i
    lim: torch.Tensor  # L_j: counts 1..L_j are below x_j / f (eager under bucket x_j); L_j <= j - 1

    @classmethod
    def build(cls, xs: list[int], hs: list[int], f: float, unit: int, g: int, scale: int) -> _Steps:
        x = torch.tensor([0, *xs], dtype=torch.int64)
        hp = torch.cumsum(torch.tensor([0, *hs], dtype=torch.int64), 0)
        wp = torch.cumsum(torch.tensor([0, *(a * b for a, b in zip(xs, hs))], dtype=torch.int64), 0)
        a = unit * x - g
        lim = torch.searchsorted(x[1:].double() * f, x.double(), side="left")
        lim[0] = 0
        return cls(a=a, column=scale * (a * hp - unit * wp) + 1, q=scale * hp, r=scale * unit * wp, lim=lim)

    def after_prefix(self, prefix: torch.Tensor) -> torch.Tensor:
        """For every j: prefix[L_j] + key(L_j, j), the best step from a bucket at or below x_{L_j} when
        ``prefix`` is the running minimum of the previous layer (every such step costs the same)."""
        lim = self.lim
        return prefix[lim] + self.r[lim] - self.a * self.q[lim] + self.column

    def layer(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """F_new[j] = min over i < j of prev[i] + key(i, j), and the leftmost i attaining it."""
        idx = torch.arange(prev.numel())
        base = prev + self.r  # row terms that do not depend on the column
        # i <= L_j: every such i pays key(L_j, j); take the leftmost prefix minimum of prev
        prefix = torch.cummin(prev, 0).values
        first = torch.where(prev < torch.cat([prefix[:1] + 1, prefix[:-1]]), idx, 0)
        first = torch.cummax(first, 0).values  # leftmost index attaining each prefix minimum
        value = self.after_prefix(prefix)
        choice = first[self.lim]
        # L_j < i < j: the Monge band, by divide and conquer
        band_cols = torch.nonzero(self.lim + 1 <= idx - 1).flatten()
        if band_cols.numel():
            band_value, band_choice = self._band(base, band_cols)
            old = value[band_cols]
            better = band_value < old  # ties: the prefix side has the smaller i
            value[band_cols] = torch.where(better, band_value, old)
            choice[band_cols] = torch.where(better, band_choice, choice[band_cols])
        value[0], choice[0] = 0, 0
        return value, choice

    def _band(self, base: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """min over L_j < i < j of base[i] - a_j * q_i + column_j for each j in ``cols``, leftmost argmin.

        The leftmost argmin is nondecreasing along ``cols`` (Monge band), so the subproblems of one level
        of the recursion search row ranges that overlap only at their ends: one batch per level."""
        m = cols.numel()
        best = torch.empty(m, dtype=torch.int64)
        arg = torch.empty(m, dtype=torch.int64)
        lo_t = torch.zeros(1, dtype=torch.int64)  # subproblem: positions lo..hi of cols, rows in [olo, ohi]
        hi_t = torch.full((1,), m - 1, dtype=torch.int64)
        olo = torch.ones(1, dtype=torch.int64)
        ohi = torch.full((1,), base.numel() - 1, dtype=torch.int64)
        while lo_t.numel():
            t = lo_t.numel()
            mid = (lo_t + hi_t) // 2
            j = cols[mid]
            r_lo = torch.maximum(olo, self.lim[j] + 1)
            lens = torch.minimum(ohi, j - 1) - r_lo + 1  # >= 1: the argmin lies in [olo, ohi]
            task = torch.repeat_interleave(torch.arange(t), lens)
            rows = torch.arange(task.numel()) + (r_lo - (torch.cumsum(lens, 0) - lens))[task]
            vals = base[rows] - self.a[j][task] * self.q[rows]
            mins = torch.full((t,), _INT64_SAFE).scatter_reduce(0, task, vals, "amin")
            at_min = torch.where(vals == mins[task], rows, _INT64_SAFE)
            opt = torch.full((t,), _INT64_SAFE).scatter_reduce(0, task, at_min, "amin")
            best[mid], arg[mid] = mins + self.column[j], opt
            left, right = lo_t <= mid - 1, mid + 1 <= hi_t
            lo_t = torch.cat([lo_t[left], (mid + 1)[right]])
            hi_t = torch.cat([(mid - 1)[left], hi_t[right]])
            olo = torch.cat([olo[left], opt[right]])
            ohi = torch.cat([opt[left], ohi[right]])
        return best, arg

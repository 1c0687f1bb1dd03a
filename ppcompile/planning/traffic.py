"""Traffic records: how many forwards of each live token count a stage served.

``TokenHistogram`` counts forwards by token count. Counts up to ``max_exact_tokens`` (default
``MAX_EXACT_TOKENS`` = 65536, eight times the default capture cap) are kept exactly, in a list
preallocated at construction, so ``record(n)`` is one bounds check and one increment: O(1), no
container growth. Larger counts are kept per power-of-two range (forwards and their token sum), exact
in totals but not in the individual count; no capture ladder reaches them anyway.

Histograms add up (``merge``, ``+``, ``sum(...)``) across stages, ranks and processes, and travel as a
small JSON document (``to_json``/``save``):

```json
{"format": "ppcompile.token_histogram", "version": 1, "max_exact_tokens": 65536,
 "counts": [[17, 3], [2048, 95012]],
 "overflow": [[65537, 131071, 2, 150000]]}
```

``counts`` lists ``[token count, forwards]`` for counts up to ``max_exact_tokens``; ``overflow`` lists
``[lowest, highest, forwards, tokens]`` per range above it. ``process_histogram()`` is the process-wide
histogram that stage runtimes feed (``TokenHistogram(feeds=process_histogram())``);
``ppcompile.token_histogram()`` returns a copy of it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

__all__ = [
    "FORMAT",
    "MAX_EXACT_TOKENS",
    "VERSION",
    "TokenHistogram",
    "process_histogram",
    "token_histogram",
]

MAX_EXACT_TOKENS = 65536
"""Default bound of exact counting: 8x the default capture cap (8192); 0.5 MiB of list per histogram."""
FORMAT = "ppcompile.token_histogram"
VERSION = 1
_MAX_BOUND = 1 << 24  # a larger exact bound is a mistake (a 128 MiB list), not a choice


class TokenHistogram:
    """Forwards served, by live token count: exact up to ``max_exact_tokens``, per octave above.

    ``feeds``: another histogram (e.g. ``process_histogram()``) that every ``record`` also updates, so a
    stage keeps its own traffic and the process-wide one at O(1) cost. Increments take no lock: threads
    recording into one histogram at the same time may lose a count now and then.
    """

    __slots__ = ("_exact", "_feeds", "_max", "_over_forwards", "_over_tokens")

    def __init__(self, max_exact_tokens: int = MAX_EXACT_TOKENS, *, feeds: TokenHistogram | None = None):
        if isinstance(max_exact_tokens, bool) or not isinstance(max_exact_tokens, int) or not (
            1 <= max_exact_tokens <= _MAX_BOUND
        ):
            raise ValueError(f"TokenHistogram: max_exact_tokens must be an int in 1..{_MAX_BOUND}, got "
                             f"{max_exact_tokens!r}")
        if feeds is not None and not isinstance(feeds, TokenHistogram):
            raise ValueError(f"TokenHistogram: feeds must be a TokenHistogram or None, got {type(feeds)}")
        self._max = max_exact_tokens
        self._exact = [0] * (max_exact_tokens + 1)  # index = token count; index 0 unused
        # index = n.bit_length() for n > max_exact_tokens (64 slots cover any int64 count)
        self._over_forwards = [0] * 65
        self._over_tokens = [0] * 65
        self._feeds = feeds

    @property
    def max_exact_tokens(self) -> int:
        """Counts up to this are kept exactly."""
        return self._max

    def record(self, n: int) -> None:
        """Counts one forward of ``n`` live tokens (``n >= 1``). The hot path: O(1), no growth."""
        if 0 < n <= self._max:
            self._exact[n] += 1
        else:
            self._record_large(n)
        if self._feeds is not None:
            self._feeds.record(n)

    def _record_large(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"TokenHistogram.record: a forward has at least 1 token, got {n!r}")
        k = n.bit_length()
        if k >= len(self._over_forwards):
            raise ValueError(f"TokenHistogram.record: {n} tokens is beyond any real forward (>= 2**64)")
        self._over_forwards[k] += 1
        self._over_tokens[k] += n

    @property
    def total(self) -> int:
        """Forwards recorded."""
        return sum(self._exact) + sum(self._over_forwards)

    @property
    def total_tokens(self) -> int:
        """Live tokens over all forwards recorded (exact, overflow included)."""
        return sum(n * c for n, c in enumerate(self._exact) if c) + sum(self._over_tokens)

    @property
    def overflow_forwards(self) -> int:
        """Forwards above ``max_exact_tokens`` (their individual counts are not kept)."""
        return sum(self._over_forwards)

    def counts(self) -> dict[int, int]:
        """``{token count: forwards}`` of the nonzero entries, ascending. Each range above
        ``max_exact_tokens`` shows as one entry at its mean count (rounded half up)."""
        out = {n: c for n, c in enumerate(self._exact) if c}
        for k, c in enumerate(self._over_forwards):
            if c:
                low, high = self._octave(k)
                out[min(high, max(low, (self._over_tokens[k] + c // 2) // c))] = c
        return out

    def overflow(self) -> list[tuple[int, int, int, int]]:
        """``(lowest, highest, forwards, tokens)`` per nonempty range above ``max_exact_tokens``."""
        return [(*self._octave(k), c, self._over_tokens[k]) for k, c in enumerate(self._over_forwards) if c]

    def _octave(self, k: int) -> tuple[int, int]:
        return max(1 << (k - 1), self._max + 1), (1 << k) - 1

    def reset(self) -> None:
        """Sets every count back to zero (in place: holders of this histogram keep recording into it)."""
        for table in (self._exact, self._over_forwards, self._over_tokens):
            table[:] = [0] * len(table)

    def copy(self) -> TokenHistogram:
        """A snapshot with the same counts, feeding nothing."""
        other = TokenHistogram(self._max)
        other._exact[:] = self._exact
        other._over_forwards[:] = self._over_forwards
        other._over_tokens[:] = self._over_tokens
        return other

    def merge(self, other: TokenHistogram) -> TokenHistogram:
        """Adds ``other``'s counts into this histogram (not into the one it feeds); returns ``self``."""
        if not isinstance(other, TokenHistogram):
            raise TypeError(f"TokenHistogram.merge: expected a TokenHistogram, got {type(other).__name__}")
        if other._max != self._max:
            raise ValueError(f"TokenHistogram.merge: max_exact_tokens differ ({self._max} vs {other._max}); "
                             "counts above the smaller bound cannot be placed exactly")
        for mine, theirs in ((self._exact, other._exact), (self._over_forwards, other._over_forwards),
                             (self._over_tokens, other._over_tokens)):
            for i, c in enumerate(theirs):
                if c:
                    mine[i] += c
        return self

    def __add__(self, other: TokenHistogram) -> TokenHistogram:
        if not isinstance(other, TokenHistogram):
            return NotImplemented
        return self.copy().merge(other)

    def __radd__(self, other: object) -> TokenHistogram:
        if other == 0:  # sum(histograms) starts from 0
            return self.copy()
        return NotImplemented

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TokenHistogram):
            return NotImplemented
        return (self._max, self._exact, self._over_forwards, self._over_tokens) == (
            other._max, other._exact, other._over_forwards, other._over_tokens)

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        counts = self.counts()
        top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
        return (f"TokenHistogram({self.total} forwards, {len(counts)} distinct counts, most frequent "
                f"{dict(top)})")

    # -- JSON -------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (module docstring) as a dict."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "max_exact_tokens": self._max,
            "counts": [[n, c] for n, c in enumerate(self._exact) if c],
            "overflow": [list(entry) for entry in self.overflow()],
        }

    def to_json(self) -> str:
        """The JSON document as a string (compact)."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, doc: Any, source: str = "histogram") -> TokenHistogram:
        """Reads the JSON document; a malformed one raises ``ValueError`` naming ``source`` and the
        problem."""
        def bad(problem: str) -> ValueError:
            return ValueError(f"{source}: {problem}")

        if not isinstance(doc, Mapping):
            raise bad(f"expected a JSON object, got {type(doc).__name__}")
        if doc.get("format") != FORMAT:
            raise bad(f"'format' is {doc.get('format')!r}, expected {FORMAT!r} (not a token histogram)")
        if doc.get("version") != VERSION:
            raise bad(f"'version' is {doc.get('version')!r}; this ppcompile reads version {VERSION}")
        bound = doc.get("max_exact_tokens")
        if not (_is_int(bound) and 1 <= bound <= _MAX_BOUND):
            raise bad(f"'max_exact_tokens' must be an int in 1..{_MAX_BOUND}, got {bound!r}")
        unknown = sorted(set(doc) - {"format", "version", "max_exact_tokens", "counts", "overflow"})
        if unknown:
            raise bad(f"unknown key(s) {unknown}")
        hist = cls(bound)
        seen: set[int] = set()
        for i, entry in enumerate(_entries(doc, "counts", 2, bad)):
            n, c = entry
            if not 1 <= n <= bound:
                raise bad(f"counts[{i}]: token count {n} is outside 1..max_exact_tokens={bound}")
            if n in seen:
                raise bad(f"counts[{i}]: token count {n} appears twice")
            seen.add(n)
            hist._exact[n] = c
        seen.clear()
        for i, entry in enumerate(_entries(doc, "overflow", 4, bad)):
            low, high, c, tokens = entry
            k = high.bit_length()
            if k >= len(hist._over_forwards) or high <= bound or (low, high) != hist._octave(k):
                raise bad(f"overflow[{i}]: [{low}, {high}] is not a power-of-two range above "
                          f"max_exact_tokens={bound}")
            if k in seen:
                raise bad(f"overflow[{i}]: range [{low}, {high}] appears twice")
            seen.add(k)
            if not c * low <= tokens <= c * high:
                raise bad(f"overflow[{i}]: {tokens} tokens cannot come from {c} forwards of {low}..{high}")
            hist._over_forwards[k], hist._over_tokens[k] = c, tokens
        return hist

    @classmethod
    def from_json(cls, text: str | bytes, source: str = "histogram") -> TokenHistogram:
        """Parses the JSON document; malformed JSON or content raises ``ValueError``."""
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source}: not valid JSON ({e})") from None
        return cls.from_dict(doc, source)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the JSON document to ``path`` (atomically: a reader never sees half a file)."""
        tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(self.to_json() + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TokenHistogram:
        """Reads a file written by ``save``; a missing file raises ``FileNotFoundError``, a malformed
        one ``ValueError`` naming the file and the problem."""
        with open(path) as f:
            text = f.read()
        return cls.from_json(text, source=os.fspath(path))


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _entries(
    doc: Mapping[str, Any], key: str, width: int, bad: Callable[[str], ValueError]
) -> list[list[int]]:
    """``doc[key]`` as a list of entries of ``width`` ints >= 0 each."""
    entries = doc.get(key, [])
    if not isinstance(entries, list):
        raise bad(f"'{key}' must be a list, got {type(entries).__name__}")
    for i, entry in enumerate(entries):
        if not isinstance(entry, list) or len(entry) != width or not all(map(_is_int, entry)):
            raise bad(f"{key}[{i}]: expected a list of {width} ints, got {entry!r}")
        if any(v < 0 for v in entry):
            raise bad(f"{key}[{i}]: negative value in {entry!r}")
    return entries


_PROCESS = TokenHistogram()


def process_histogram() -> TokenHistogram:
    """The process-wide histogram (live: it keeps counting). Stage runtimes feed it; reset it with
    ``process_histogram().reset()``."""
    return _PROCESS


def token_histogram() -> TokenHistogram:
    """A snapshot copy of the process-wide histogram of live token counts served."""
    return _PROCESS.copy()


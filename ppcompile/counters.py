"""Process-wide counters of what compiled stages did, for tests, logs and benchmarks.

``replays`` and ``eager_runs`` count stage forwards (one per call of a compiled stage) by the path that served
them; ``whole_replays`` counts the replays that were whole-stage graphs (one graph per bucket, breaks inside:
``runtime/whole_stage.py``); ``replays_by_bucket`` splits replays by bucket; ``captures`` counts captured
(segment, bucket) graphs, a whole-stage graph as one; ``backend_compiles`` counts calls of the backend by
Dynamo; ``segment_compiles`` counts graph segments actually compiled (unique structures; eager segments
compile nothing) and ``segment_cache_hits`` the segments that reused an artifact of the same structure;
``eager_code_reuses`` the eager segments that run an alike segment's generated code; ``fall_offs`` counts, by
cause, the stage graphs whose forwards stopped reaching the graph path for a reason other than the documented
policy (``StageRuntime.fall_offs()``: one warning per module and cause, however many stage graphs Dynamo
recompiles for it); ``input_recompiles`` counts stage graphs Dynamo recompiled for inputs of another structure
than the first call's (a proxy key gone or new, a dtype, device or rank: most likely a bad input), and failed
recompiles of a stage frame (its trace raised, as for a missing proxy key); ``token_count_mismatches`` counts
forwards whose inputs marked dynamic one by one, served as one token count, differed in size (run eagerly,
``runtime/token_counts.py``); ``fence_waits`` counts, by kind of fence, the send fences a stage waited before
reusing an output ring slot (``ppcompile.fence_outputs``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Iterator
from typing import Any

__all__ = ["Counters", "counters"]


@dataclasses.dataclass
class Counters:
    replays: int = 0
    whole_replays: int = 0
    eager_runs: int = 0
    captures: int = 0
    backend_compiles: int = 0
    segment_compiles: int = 0
    segment_cache_hits: int = 0
    eager_code_reuses: int = 0
    input_recompiles: int = 0
    token_count_mismatches: int = 0
    replays_by_bucket: Counter[int] = dataclasses.field(default_factory=Counter)
    fall_offs: Counter[str] = dataclasses.field(default_factory=Counter)
    fence_waits: Counter[str] = dataclasses.field(default_factory=Counter)

    def reset(self) -> None:
        """Sets every count back to zero."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Counter):
                value.clear()
            else:
                setattr(self, f.name, 0)

    def snapshot(self) -> dict[str, Any]:
        """A copy of the current counts."""
        return {
            f.name: dict(value) if isinstance(value := getattr(self, f.name), Counter) else value
            for f in dataclasses.fields(self)
        }

    @contextlib.contextmanager
    def expect(self, **deltas: Any) -> Iterator[None]:
        """Asserts that the block changes each named count by exactly the given delta.

        ``replays_by_bucket``, ``fall_offs`` and ``fence_waits`` take a dict ``{key: delta}``; keys not
        named must not change.
        """
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(deltas) - names)
        if unknown:
            raise ValueError(f"counters.expect: unknown counter(s) {unknown}; valid: {sorted(names)}")
        before = self.snapshot()
        yield
        after = self.snapshot()
        errors = []
        for name, want in deltas.items():
            if isinstance(getattr(self, name), Counter):
                keys = set(before[name]) | set(after[name]) | set(want)
                got = {k: after[name].get(k, 0) - before[name].get(k, 0) for k in keys}
                got = {k: v for k, v in got.items() if v}
                want = {k: v for k, v in want.items() if v}
            else:
                got = after[name] - before[name]
            if got != want:
                errors.append(f"{name}: expected change {want}, got {got}")
        if errors:
            raise AssertionError("counters.expect failed: " + "; ".join(errors))


counters = Counters()

"""Token buckets: which sizes are captured, and which bucket (or eager) serves a token count.

The default ladder (``config.default_capture_ladder``, policy that the options validate against) is
dense for small counts and geometric above 32 tokens, with 8 buckets per octave, so padding waste above 32
tokens stays under 12.5%: ``1, 2, 4, 8, 12, ..., 32, 36, 40, ..., 64, 72, ..., 128, 144, ..., 4096, 4608,
..., 8192``. It stops at ``max_capture_tokens`` (which is appended when it is off the grid, so a forward
at exactly the cap is graphed). Explicit ``capture_sizes`` replace it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ppcompile.config import PPBreakableConfig, default_capture_ladder

__all__ = ["BucketPlan", "default_capture_ladder", "make_bucket_plan"]

@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """Capture sizes and the per-token-count dispatch table.

    ``bucket_for[n]`` is the bucket that serves ``n`` tokens, or 0 when ``n`` runs eagerly (above the
    cap, or padding beyond ``max_padding_factor``). Built once at compile time; lookups are O(1).
    ``refused``: sizes of the ladder the stage graph cannot run at (its shape guards fail there).
    """

    sizes: tuple[int, ...]
    max_padding_factor: float
    bucket_for: tuple[int, ...]
    refused: tuple[int, ...] = ()

    @property
    def cap(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def bucket(self, num_tokens: int) -> int | None:
        """The bucket serving ``num_tokens``, or None when it runs eagerly."""
        if 0 < num_tokens < len(self.bucket_for):
            return self.bucket_for[num_tokens] or None
        return None

    def eager_reason(self, num_tokens: int) -> str | None:
        """Why ``num_tokens`` runs eagerly, or None when a bucket serves it."""
        if self.bucket(num_tokens) is not None:
            return None
        if num_tokens < 1:
            return f"{num_tokens} tokens: nothing to pad"
        refused = next((s for s in self.refused if s >= num_tokens), None)
        if refused is not None and (num_tokens > self.cap or refused < self.sizes[-1]):
            return (f"bucket {refused} for {num_tokens} tokens is outside the token counts the stage graph "
                    "was traced for (a shape guard of Dynamo fails there)")
        if num_tokens > self.cap:
            return f"{num_tokens} tokens is above the capture cap {self.cap}"
        nxt = next(s for s in self.sizes if s >= num_tokens)
        return (
            f"bucket {nxt} for {num_tokens} tokens pads more than max_padding_factor="
            f"{self.max_padding_factor:g}"
        )

    def padding_table(self) -> list[tuple[int, int | None, float]]:
        """``(num_tokens, bucket or None, padded fraction)`` for every count up to the cap."""
        rows = []
        for n in range(1, self.cap + 1):
            b = self.bucket(n)
            rows.append((n, b, (b - n) / n if b else 0.0))
        return rows


def make_bucket_plan(config: PPBreakableConfig, admits: Callable[[int], bool] | None = None) -> BucketPlan:
    """The bucket plan for a config: explicit ``capture_sizes`` or the default ladder, less the sizes
    ``admits`` refuses (the stage graph's shape guards fail there; counts they would serve go to the next
    admitted bucket or run eagerly)."""
    ladder = config.capture_sizes or default_capture_ladder(config.max_capture_tokens)
    sizes = [s for s in ladder if admits is None or admits(s)]
    table = [0] * ((sizes[-1] if sizes else 0) + 1)
    i = 0
    for n in range(1, len(table)):
        while sizes[i] < n:
            i += 1
        b = sizes[i]
        table[n] = b if b <= config.max_padding_factor * n else 0
    refused = tuple(s for s in ladder if s not in sizes)
    return BucketPlan(sizes=tuple(sizes), max_padding_factor=config.max_padding_factor,
                      bucket_for=tuple(table), refused=refused)

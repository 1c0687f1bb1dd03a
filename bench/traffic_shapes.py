"""Synthetic prefill traffic for the bucket planner: three shapes of 100k forwards each, as token
histograms (``TokenHistogram`` JSON) under ``bench/traffic/``. Deterministic: each shape has a seed.

- ``chunked_2048``: chunked prefill at a 2048-token chunk. Prompts arrive as a Poisson stream (about 1.06
  per step, 85% of the chunk's capacity) with log-normal lengths (median 1000 tokens, sigma 1.0, at most
  32768); each step the scheduler packs queued prompts, splitting the head one, into one forward of at
  most 2048 tokens. Forwards fill the chunk while a backlog lasts; the others are the tails.
- ``bimodal``: 70% short forwards of 8..64 tokens, 30% long ones of 1024..2048 (uniform within each).
- ``uniform``: 1..2048 tokens, uniform.

Run: ``python bench/traffic_shapes.py`` (rewrites the JSON files; ``--forwards N`` for another size).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ppcompile.planning.traffic import TokenHistogram

__all__ = ["SHAPES", "TRAFFIC_DIR", "bimodal", "chunked_prefill", "load_shapes", "uniform"]

TRAFFIC_DIR = Path(__file__).resolve().parent / "traffic"
FORWARDS = 100_000
CHUNK = 2048


def chunked_prefill(forwards: int, rng: random.Random, chunk: int = CHUNK, load: float = 0.85,
                    median: float = 1000.0, sigma: float = 1.0, longest: int = 32768) -> list[int]:
    """Token counts of ``forwards`` chunked-prefill forwards (module docstring)."""
    mean_prompt = median * math.exp(sigma * sigma / 2)
    rate = load * chunk / mean_prompt  # prompts per step
    queue: deque[int] = deque()
    out: list[int] = []
    next_arrival = rng.expovariate(rate)
    step = 0
    while len(out) < forwards:
        step += 1
        while next_arrival <= step:
            queue.append(min(longest, max(1, round(rng.lognormvariate(math.log(median), sigma)))))
            next_arrival += rng.expovariate(rate)
        budget = chunk
        while queue and budget:
            take = min(queue[0], budget)
            budget -= take
            if take == queue[0]:
                queue.popleft()
            else:
                queue[0] -= take
        if budget < chunk:
            out.append(chunk - budget)
    return out


def bimodal(forwards: int, rng: random.Random, short: float = 0.7) -> list[int]:
    """``short`` of the forwards take 8..64 tokens, the rest 1024..2048."""
    return [rng.randint(8, 64) if rng.random() < short else rng.randint(1024, 2048) for _ in range(forwards)]


def uniform(forwards: int, rng: random.Random) -> list[int]:
    """1..2048 tokens, uniform."""
    return [rng.randint(1, CHUNK) for _ in range(forwards)]


SHAPES: dict[str, tuple[Callable[[int, random.Random], list[int]], int]] = {
    "chunked_2048": (chunked_prefill, 2048),
    "bimodal": (bimodal, 64),
    "uniform": (uniform, 1),
}
"""name -> (generator, seed)."""


def histogram_of(counts: Sequence[int]) -> TokenHistogram:
    hist = TokenHistogram()
    for n in counts:
        hist.record(n)
    return hist


def load_shapes(folder: Path = TRAFFIC_DIR) -> dict[str, TokenHistogram]:
    """The committed shapes, by name."""
    return {name: TokenHistogram.load(folder / f"{name}.json") for name in SHAPES}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forwards", type=int, default=FORWARDS, help=f"forwards per shape ({FORWARDS})")
    parser.add_argument("--out", type=Path, default=TRAFFIC_DIR, help="folder for the JSON files")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, (generate, seed) in SHAPES.items():
        hist = histogram_of(generate(args.forwards, random.Random(seed)))
        hist.save(args.out / f"{name}.json")
        top, share = max(hist.counts().items(), key=lambda kv: kv[1])
        print(f"{name}: {hist.total} forwards, {len(hist.counts())} distinct counts, most frequent {top} "
              f"({100 * share / hist.total:.1f}%) -> {args.out / (name + '.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

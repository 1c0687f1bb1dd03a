"""The planning benchmark's traffic shapes: deterministic, the right shapes, committed in full."""

from __future__ import annotations

import random
from pathlib import Path

from ppcompile.cli import bench as bench_cli
from ppcompile.planning.traffic import TokenHistogram

shapes = bench_cli._bench("traffic_shapes")
planning = bench_cli._bench("planning")


def test_shapes_are_deterministic_and_shaped(tmp_path: Path) -> None:
    assert shapes.main(["--forwards", "3000", "--out", str(tmp_path)]) == 0
    hists = {name: TokenHistogram.load(tmp_path / f"{name}.json") for name in shapes.SHAPES}
    assert all(h.total == 3000 for h in hists.values())
    chunked = hists["chunked_2048"].counts()
    assert max(chunked) == 2048 and chunked[2048] > 0.5 * 3000  # mostly full chunks, then tails
    assert set(hists["bimodal"].counts()) <= set(range(8, 65)) | set(range(1024, 2049))
    assert max(hists["uniform"].counts()) <= 2048
    assert shapes.chunked_prefill(500, random.Random(1)) == shapes.chunked_prefill(500, random.Random(1))


def test_committed_shapes_load() -> None:
    loaded = shapes.load_shapes()
    assert set(loaded) == set(shapes.SHAPES) and all(h.total == shapes.FORWARDS for h in loaded.values())


def test_fewest_matching_finds_the_first_plan_as_good_as_the_default() -> None:
    hist = TokenHistogram()
    for n in [2048] * 50 + [1024] * 10 + [7] * 3:
        hist.record(n)
    default = planning.evaluate_ladder(hist, [7, 1024, 2048, 4096])
    assert planning.fewest_matching(hist, default, 8) == {"padding": 3, "graphed": 2, "both": 3}

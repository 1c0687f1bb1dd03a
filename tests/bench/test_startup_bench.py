"""bench/startup.py's report: the table and the verdicts against the issue's targets, from given rows (the
measurement itself runs fresh processes for minutes and is no test)."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from bench import startup
from bench.compile_time import WARM_START
from bench.report import full_collections, machine_info
from bench.startup import COMPILERS, RESTARTS, render


def _row(layers: int, compiler: str, start: str, total: float) -> dict[str, Any]:
    return {"layers": layers, "compiler": compiler, "start": start, "region_calls": 0, "region_traces": 0,
            "dynamo_trace": total / 2, "passes": 0.01, "segment_compile": 0.0, "capture": total / 4,
            "total": total}


def test_the_report_says_which_targets_are_met() -> None:
    # 4 -> 32 layers: eager + once 1.4x (target 1.5: met), inductor + once 1.5x (target 1.3: not met);
    # torch's caches alone at 0.9x cold; a warm_compile restart at 0.2x cold (met) for eager segments,
    # 0.5x (not met) for Inductor's.
    cold = {"eager": (1.0, 3.0), "eager + once": (1.0, 1.4), "inductor": (2.0, 4.0),
            "inductor + once": (2.0, 3.0), "eager + once (regions)": (1.0, 1.6),
            "inductor + once (regions)": (2.0, 2.4)}
    rows = []
    for compiler in COMPILERS:
        lo, hi = cold[compiler]
        rows += [_row(4, compiler, "cold", lo), _row(4, compiler, "warm", lo * 0.9),
                 _row(32, compiler, "cold", hi), _row(32, compiler, "warm", hi * 0.9)]
    for compiler in RESTARTS:
        lo, hi = cold[compiler]
        restart = 0.2 if compiler == "eager" else 0.5
        for layers, total in ((4, lo), (32, hi)):
            rows += [_row(layers, compiler + WARM_START, "store", total * 1.1),
                     {**_row(layers, compiler + WARM_START, "restart", total * restart), "dynamo_trace": None,
                      "read_back": 0.05}]
    moe = [{**_row(n, c, "cold", t), "experts": 4, "region_calls": n if c.endswith("(regions)") else 0,
            "stamped_layers": n - 1 if c.endswith("once") else 0}
           for n, c, t in ((4, "eager", 2.0), (4, "eager + once (regions)", 1.8), (4, "eager + once", 1.6),
                           (32, "eager", 8.0), (32, "eager + once (regions)", 2.6),
                           (32, "eager + once", 2.0))]
    moe[-1].update(full_collections=1, full_collection_seconds=0.18)
    text = render({"info": machine_info("cpu", threads=1), "max_tokens": 64, "repeats": 1, "capture": "lazy",
                   "rows": rows + moe})
    assert text.startswith("## Startup\n")
    assert "capture ladder up to 64, `capture=\"lazy\"` (the first call captures its own bucket" in text
    whole = render({"info": machine_info("cpu", threads=1), "max_tokens": 64, "repeats": 1, "capture": "all",
                    "rows": rows})
    assert "`capture=\"all\"` (the first call captures the whole ladder" in whole
    assert "garbage collection" not in whole
    assert ("- full garbage collections in the first call (CPython's, of the whole heap): MoE, 32 layers "
            "eager + once cold: 1 (0.18 s).") in text
    assert "| 32 | inductor + once | cold |" in text
    assert "- cold, eager + once segments, 32 vs 4 layers: 1.40x (target <= 1.5x: met)" in text
    assert "- cold, inductor + once segments, 32 vs 4 layers: 1.50x (target <= 1.3x: not met)" in text
    assert "- cold, inductor + once (regions) segments, 32 vs 4 layers: 1.20x; Dynamo" in text  # no target
    assert "- cold, eager segments, 32 vs 4 layers: 3.00x; Dynamo trace 3.00x" in text  # no target
    assert "- warm vs cold, inductor segments, 32 layers, torch's caches alone: 0.90x." in text
    assert "- restart vs cold, eager segments, 32 layers: 0.20x (target <= 0.25x: met)." in text
    assert "- restart vs cold, inductor segments, 4 layers: 0.50x (target <= 0.25x: not met)." in text
    assert "| 32 | eager + warm start | restart | 0 / 0 | 0 | n/a | 0.05 s |" in text
    assert ("- where a restart spends its first call, eager segments, 32 layers: read back 0.05 s, "
            "passes 0.01 s, segment compile 0.00 s, capture 0.15 s, the rest" in text)
    assert "The same stage with MoE layers (4 experts each" in text
    assert "| 32 | eager + once (regions) | 32 / 0 | 0 | 1.30 s |" in text  # the MoE table, not the dense one
    assert "| 32 | eager + once | 0 / 0 | 31 | 1.00 s |" in text
    assert "- cold, MoE stage, eager + once segments, 32 vs 4 layers: 1.25x (target <= 1.5x: met)." in text
    assert "- cold, MoE stage, eager segments, 32 vs 4 layers: 4.00x." in text
    assert "- MoE stage, 32 layers, eager + once (regions) vs flat: Dynamo trace 0.33x, first call 0.33x." \
        in text
    assert "- MoE stage, 32 layers, eager + once vs flat: Dynamo trace 0.25x, first call 0.25x." in text


def test_cold_rows_take_their_repeats_in_rounds_and_keep_the_fastest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each round runs every cold row once, so a drift of the machine's speed reaches the 4- and 32-layer
    rows alike; each row keeps its fastest process."""
    calls: list[tuple[int, str, int]] = []

    def child(layers: int, compiler: str, env: dict[str, str], max_tokens: int | None, capture: str,
              experts: int = 0) -> dict[str, Any]:
        calls.append((layers, compiler, experts))
        return {"layers": layers, "compiler": compiler, "total": 10.0 - len(calls) % 3}

    monkeypatch.setattr(startup, "_child", child)
    best = startup._cold_rows([4, 32], 3, {}, None, "lazy")
    kinds = [(n, c, 0) for n in (4, 32) for c in COMPILERS] + [
        (n, c, startup.MOE_EXPERTS) for n in (4, 32) for c in startup.MOE_COMPILERS]
    assert calls == kinds * 3
    for kind in kinds:
        totals = [10.0 - (i + 1) % 3 for i, call in enumerate(calls) if call == kind]
        assert best[kind]["total"] == min(totals)


def test_full_collections_times_each_collection_of_the_oldest_generation() -> None:
    with full_collections() as seconds:
        gc.collect(0)  # a young one: not counted
        gc.collect()
        gc.collect()
    gc.collect()  # after: not counted
    assert len(seconds) == 2 and all(s >= 0 for s in seconds)

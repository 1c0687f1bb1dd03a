"""``TokenHistogram``: recording, overflow ranges, merging, JSON round trips and malformed files, and the
process-wide histogram behind ``ppcompile.token_histogram()``."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ppcompile
from ppcompile.planning.traffic import (
    FORMAT,
    MAX_EXACT_TOKENS,
    TokenHistogram,
    process_histogram,
    token_histogram,
)

token_counts = st.lists(st.integers(1, 300), max_size=60)


def _of(counts: list[int], bound: int = MAX_EXACT_TOKENS) -> TokenHistogram:
    hist = TokenHistogram(bound)
    for n in counts:
        hist.record(n)
    return hist


@settings(max_examples=50, deadline=None)
@given(token_counts)
def test_record_counts_each_forward(counts: list[int]) -> None:
    hist = _of(counts)
    assert hist.counts() == dict(sorted(Counter(counts).items()))
    assert hist.total == len(counts) and hist.total_tokens == sum(counts)
    assert hist.overflow_forwards == 0 and hist.overflow() == []


def test_counts_above_the_bound_are_kept_per_power_of_two_range() -> None:
    hist = _of([5, 8, 9, 20, 17, 100], bound=8)
    assert hist.counts() == {5: 1, 8: 1, 9: 1, 19: 2, 100: 1}  # 17 and 20 shown at their mean
    assert hist.overflow() == [(9, 15, 1, 9), (16, 31, 2, 37), (64, 127, 1, 100)]
    assert hist.total == 6 and hist.total_tokens == 159 and hist.overflow_forwards == 4


@pytest.mark.parametrize("n", [0, -1, -MAX_EXACT_TOKENS])
def test_record_rejects_counts_below_one(n: int) -> None:
    hist = TokenHistogram()
    with pytest.raises(ValueError, match="at least 1 token"):
        hist.record(n)
    assert hist.total == 0  # a negative count must not wrap around the list


def test_bad_bound_and_feeds_are_rejected() -> None:
    with pytest.raises(ValueError, match="max_exact_tokens"):
        TokenHistogram(0)
    with pytest.raises(ValueError, match="feeds"):
        TokenHistogram(feeds={})  # type: ignore[arg-type]


def test_a_stage_histogram_feeds_another() -> None:
    process = TokenHistogram()
    stage = TokenHistogram(feeds=process)
    for n in (3, 3, 70000):
        stage.record(n)
    assert stage == process and stage.counts() == {3: 2, 70000: 1}
    stage.reset()
    assert stage.total == 0 and process.total == 3  # reset leaves the fed histogram alone


@settings(max_examples=50, deadline=None)
@given(token_counts, token_counts)
def test_merge_adds_counts(a: list[int], b: list[int]) -> None:
    ha, hb = _of(a, bound=128), _of(b, bound=128)
    merged = ha + hb
    assert merged == _of(a + b, bound=128)
    assert ha == _of(a, bound=128)  # + copies
    assert sum([ha, hb]) == merged
    assert ha.merge(hb) is ha and ha == merged


def test_merge_needs_the_same_bound() -> None:
    with pytest.raises(ValueError, match="max_exact_tokens differ"):
        TokenHistogram(8).merge(TokenHistogram(16))
    with pytest.raises(TypeError):
        TokenHistogram().merge({1: 2})  # type: ignore[arg-type]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 5000), max_size=40))
def test_json_round_trip(counts: list[int]) -> None:
    hist = _of(counts, bound=100)
    again = TokenHistogram.from_json(hist.to_json())
    assert again == hist and again.max_exact_tokens == 100
    doc = json.loads(hist.to_json())
    assert doc["format"] == FORMAT and doc["version"] == 1


def test_save_and_load(tmp_path: Path) -> None:
    hist = _of([1, 2048, 2048, 90000])
    path = tmp_path / "traffic.json"
    hist.save(path)
    assert TokenHistogram.load(path) == hist
    assert [p.name for p in tmp_path.iterdir()] == ["traffic.json"]  # no temporary file left
    with pytest.raises(FileNotFoundError):
        TokenHistogram.load(tmp_path / "missing.json")


def _doc(**changes: Any) -> dict[str, Any]:
    doc = {"format": FORMAT, "version": 1, "max_exact_tokens": 16, "counts": [[3, 2], [16, 1]],
           "overflow": [[17, 31, 2, 40]]}
    doc.update(changes)
    return {k: v for k, v in doc.items() if v is not None}


@pytest.mark.parametrize(("doc", "problem"), [
    ([], "expected a JSON object"),
    (_doc(format="other"), "'format' is 'other'"),
    (_doc(version=2), "'version' is 2; this ppcompile reads version 1"),
    (_doc(max_exact_tokens=0), "'max_exact_tokens' must be an int"),
    (_doc(extra=1), r"unknown key\(s\) \['extra'\]"),
    (_doc(counts={"3": 2}), "'counts' must be a list"),
    (_doc(counts=[[3]]), r"counts\[0\]: expected a list of 2 ints"),
    (_doc(counts=[[3, 1.5]]), r"counts\[0\]: expected a list of 2 ints"),
    (_doc(counts=[[3, -1]]), r"counts\[0\]: negative value"),
    (_doc(counts=[[0, 1]]), r"counts\[0\]: token count 0 is outside 1..max_exact_tokens=16"),
    (_doc(counts=[[17, 1]]), "token count 17 is outside"),
    (_doc(counts=[[3, 1], [3, 1]]), r"counts\[1\]: token count 3 appears twice"),
    (_doc(overflow=[[16, 31, 1, 20]]), r"overflow\[0\]: \[16, 31\] is not a power-of-two range"),
    (_doc(overflow=[[5, 7, 0, 0]]), "is not a power-of-two range"),
    (_doc(overflow=[[17, 31, 2, 70]]), "70 tokens cannot come from 2 forwards of 17..31"),
    (_doc(overflow=[[17, 31, 1, 20], [17, 31, 1, 20]]), "appears twice"),
])
def test_malformed_documents_name_the_problem(doc: Any, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        TokenHistogram.from_dict(doc)


def test_malformed_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "traffic.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=f"{path}: not valid JSON"):
        TokenHistogram.load(path)
    path.write_text(json.dumps(_doc(version=None)))
    with pytest.raises(ValueError, match=f"{path}: 'version' is None"):
        TokenHistogram.load(path)


def test_token_histogram_is_a_snapshot_of_the_process_histogram() -> None:
    process = process_histogram()
    before = process.copy()
    try:
        process.reset()
        process.record(7)
        snap = ppcompile.token_histogram()
        assert ppcompile.token_histogram is token_histogram
        assert snap.counts() == {7: 1}
        process.record(7)
        assert snap.counts() == {7: 1} and token_histogram().counts() == {7: 2}
        snap.record(9)
        assert 9 not in process.counts()
    finally:
        process.reset()
        process.merge(before)

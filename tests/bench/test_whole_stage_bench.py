"""``bench/whole_stage.py`` runs on CPU (emulated graphs: the timings mean nothing there) and reports every
path per case, equal to eager, with fewer graphs for the whole path; the GPU check runs it on a device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ppcompile.cli import bench as bench_cli

whole_stage = bench_cli._bench("whole_stage")


@pytest.mark.usefixtures("fresh_dynamo")
def test_every_path_runs_equal_to_eager_and_whole_captures_fewer_graphs(tmp_path: Path) -> None:
    args = ["--device", "cpu", "--tokens", "16", "--requests", "1,4", "--layers", "2", "--calls", "1",
            "--out", str(tmp_path)]
    assert whole_stage.main(args) == 0
    result = json.loads((tmp_path / "whole_stage.json").read_text())
    assert [(r["tokens"], r["requests"]) for r in result["rows"]] == [(16, 1), (16, 4)]
    for row in result["rows"]:
        assert set(row["ms"]) == {"eager", "breakable", "whole"} and all(v > 0 for v in row["ms"].values())
        assert max(row["max_diff"].values()) < 1e-4
    captured = result["captured"]
    assert 0 < captured["whole"]["graphs"] < captured["breakable"]["graphs"]

"""``bench/pp_streams.py`` runs on CPU (its hand-over inline, no streams: the figures mean nothing there)
and reports every variant with its host synchronisations; the GPU check runs it on a device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ppcompile.cli import bench as bench_cli

pp_streams = bench_cli._bench("pp_streams")


@pytest.mark.usefixtures("fresh_dynamo")
def test_every_variant_runs_and_reports_no_host_sync(tmp_path: Path) -> None:
    assert pp_streams.main(["--device", "cpu", "--micro-batches", "3", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "pp_streams.json").read_text())
    assert [r["variant"] for r in result["rows"]] == list(pp_streams.VARIANTS)
    assert all(r["ms_per_micro_batch"] > 0 and r["host_syncs"] == 0 for r in result["rows"])
    assert result["device"] == "cpu" and result["tokens"] == 16 and result["overlap"] is not None


def test_an_unknown_variant_is_named() -> None:
    with pytest.raises(ValueError, match="variant must be one of"):
        pp_streams.run_variant(None, "overlapped", 1)

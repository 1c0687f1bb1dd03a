"""``python -m ppcompile report``: clear failures without reports (tables of a real dump: test_dump.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppcompile.cli.main import main


def test_report_of_a_folder_without_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert "no report.json under" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing")]) == 2

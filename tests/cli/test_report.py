"""``python -m ppcompile report``: clear failures without reports (tables of a real dump: test_dump.py), and
a reader that closes stdout early (every command)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ppcompile.cli.main import main
from ppcompile.debug.report import SCHEMA
from ppcompile.planning.traffic import TokenHistogram


def test_report_of_a_folder_without_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert "no report.json under" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing")]) == 2


def _closed_early(argv: list[str], read: int) -> subprocess.CompletedProcess[str]:
    """Runs ``python -m ppcompile ARGV | head -c READ``: the reader takes ``read`` bytes, then closes."""
    proc = subprocess.Popen([sys.executable, "-m", "ppcompile", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    head = proc.stdout.read(read) if read else b""
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    return subprocess.CompletedProcess(argv, proc.returncode, head.decode(errors="replace"), err)


@pytest.mark.parametrize(("command", "read"), [("report", 0), ("report", 200), ("plan", 0), ("help", 0)])
def test_a_reader_that_closes_early_ends_the_command_quietly(tmp_path: Path, command: str, read: int) -> None:
    """``python -m ppcompile report --json DIR | head``: exit 0, no BrokenPipeError traceback; the same for
    every command that prints (``plan``, argparse's help)."""
    stage = tmp_path / "stage_graph_0_0"
    stage.mkdir()
    (stage / "report.json").write_text(json.dumps({"schema": SCHEMA, "padding": ["x" * 100] * 5000}))
    traffic = tmp_path / "traffic.json"
    hist = TokenHistogram()
    for n in range(1, 3000):
        hist.record(n)
    hist.save(traffic)
    argv = {"report": ["report", "--json", str(tmp_path)],
            "plan": ["plan", "--traffic", str(traffic), "--max-buckets", "4", "--json"],
            "help": ["demo", "--help"]}[command]
    result = _closed_early(argv, read)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr
    assert len(result.stdout) == read

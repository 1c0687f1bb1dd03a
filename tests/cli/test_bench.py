"""``python -m ppcompile bench``: prints its results and writes the tracked docs only when asked."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from ppcompile.cli import bench as bench_cli
from ppcompile.cli.main import main


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(("argv", "writes"), [
    ([], False), (["--quick"], False), (["--no-docs"], False), (["--write-docs"], True), (["--write"], True),
    (["--docs-file", "x.md"], True), (["--docs-file", "x.md", "--no-docs"], False)])
def test_docs_are_written_only_when_asked(argv: list[str], writes: bool) -> None:
    args = _parse(*argv)
    assert (args.docs if args.docs is not None else args.docs_file is not None) is writes


def test_a_run_prints_and_leaves_the_docs_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The quick suite's defaults, on the cheapest benchmark: results printed and saved under --out, the
    tracked docs file untouched; --render writes docs from those results when asked to."""
    docs = tmp_path / "docs" / "benchmarks.md"
    monkeypatch.setattr(bench_cli, "DOCS", docs)
    out = tmp_path / "results"
    argv = ["bench", "--suite", "smoke", "--device", "cpu", "--only", "overhead", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "## Runtime overhead" in printed and "not changed: add --write-docs" in printed
    assert not docs.exists() and json.loads((out / "overhead.json").read_text())["segments"] > 0
    assert main(["bench", "--render", str(out)]) == 0  # --render exists to write the docs
    assert "### Runtime host overhead" in docs.read_text()

"""``bench/fused_copy.py`` says it needs CUDA and exits 0 without one; its dry run (tiny sizes through
Triton's interpreter) runs every path of the script and writes its table."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ppcompile.cli import bench as bench_cli

fused_copy = bench_cli._bench("fused_copy")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_without_cuda_it_says_so_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert fused_copy.main([]) == 0
    assert "needs a CUDA device" in capsys.readouterr().out


def test_dry_run_writes_the_table(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # restored after the test (the script sets it too)
    monkeypatch.setenv("PPCOMPILE_CACHE_DIR", str(tmp_path / "cache"))
    assert fused_copy.main(["--dry-run", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "fused_copy.md").read_text()
    assert "| k | n | bucket | torch host us | fused host us |" in table
    assert (tmp_path / "fused_copy.json").exists()

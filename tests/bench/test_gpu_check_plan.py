"""bench/gpu_check.sh fits one GPU command: its plan (``--print-plan``, nothing run) stays within the
budget, runs the preflight first and the GPU tests second, and lists exactly the test files that have GPU
tests; bench/gpu_preflight.py runs on CPU and records its CUDA checks as skipped."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ppcompile.cli import bench as bench_cli

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
BUDGET_S = 480


def _plan(*args: str) -> list[list[str]]:
    result = subprocess.run(["bash", str(SCRIPT), "--print-plan", *args], capture_output=True, text=True,
                            timeout=30, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return [line.split() for line in result.stdout.splitlines() if line.strip()]


def _values(plan: list[list[str]], key: str) -> list[list[str]]:
    return [fields[1:] for fields in plan if fields[0] == key]


def _files_with_gpu_tests() -> set[str]:
    mark = re.compile(r"pytest\.mark\.gpu\b")
    return {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*.py") if mark.search(p.read_text())}


def test_the_plan_fits_the_budget_and_its_total_adds_up() -> None:
    plan = _plan()
    steps = {name: int(limit) for name, limit in _values(plan, "step")}
    (overhead,), (total,), (budget,) = (_values(plan, k)[0] for k in ("overhead", "total", "budget"))
    assert int(budget) == BUDGET_S
    assert int(overhead) == sum(int(s) for _, s in _values(plan, "overhead_part"))
    assert int(total) == sum(steps.values()) + int(overhead)
    assert int(total) <= BUDGET_S
    assert all(limit >= 10 for limit in steps.values())


def test_preflight_first_then_the_gpu_tests_then_the_benchmarks() -> None:
    for args in ((), ("--dry-run",)):
        names = [name for name, _ in _values(_plan(*args), "step")]
        assert names[:2] == ["preflight", "pytest_gpu"], args
        assert names[2] == "throughput_profile" and len(names) == len(set(names)) == 11, args
    assert [n for n, _ in _values(_plan(), "step")] == [n for n, _ in _values(_plan("--dry-run"), "step")]


def test_the_gpu_test_list_is_exactly_the_files_with_gpu_tests() -> None:
    plan = _plan()
    listed = [f for (f,) in _values(plan, "gpu_tests")]
    assert len(listed) == len(set(listed))
    assert set(listed) == _files_with_gpu_tests()
    assert all((ROOT / f).is_file() for f in listed)
    pytest_cmd = next(" ".join(c[1:]) for c in _values(plan, "command") if c[0] == "pytest_gpu")
    assert "-m gpu" in pytest_cmd and pytest_cmd.endswith(" ".join(listed))


def test_the_plan_needs_no_python() -> None:
    """--print-plan runs before any interpreter is looked for (no torch, no CUDA needed)."""
    result = subprocess.run(["bash", str(SCRIPT), "--print-plan"], capture_output=True, text=True,
                            timeout=30, env={"PATH": "/usr/bin:/bin", "PYTHON": "/nonexistent/python"})
    assert result.returncode == 0, result.stderr
    assert "step preflight" in result.stdout


def test_preflight_on_cpu_records_every_check(tmp_path: Path) -> None:
    out = tmp_path / "preflight.json"
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_preflight.py"), "--device", "cpu",
                             "--out", str(out)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads(out.read_text())
    checks = record["checks"]
    assert list(checks) == ["versions", "cuda_device", "c_compiler", "python_headers", "test_deps",
                            "fused_copy", "cuda_graph", "nccl_graph"]
    assert record["finished"] and record["device"] == "cpu"
    assert {checks[name]["status"] for name in ("cuda_device", "cuda_graph", "nccl_graph")} == {"skipped"}
    assert checks["fused_copy"]["status"] == "ok" and checks["fused_copy"]["auto_kind"] == "torch"
    assert checks["versions"]["torch"]
    assert not (tmp_path / "preflight.json.tmp").exists()


def test_a_failing_preflight_check_is_recorded_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    gpu_preflight = bench_cli._bench("gpu_preflight")

    def broken(device: torch.device) -> dict[str, object]:
        raise OSError("no such header")

    monkeypatch.setitem(gpu_preflight.CHECKS, "python_headers", broken)
    out = tmp_path / "preflight.json"
    record = gpu_preflight.run_checks(torch.device("cpu"), out)
    assert record["checks"]["python_headers"] == {"status": "failed", "error": "OSError: no such header",
                                                  "seconds": record["checks"]["python_headers"]["seconds"]}
    assert record["checks"]["test_deps"]["status"] == "ok"  # the next check ran
    assert json.loads(out.read_text()) == json.loads(json.dumps(record, default=str))

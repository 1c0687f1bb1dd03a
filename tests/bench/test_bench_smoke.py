"""The benchmarks' code paths run, with tiny sizes (the ``smoke`` suite). No timing asserts: benchmarks
are not tests; this checks what they report is complete and consistent, and how they write the docs."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ppcompile.cli import bench as bench_cli
from ppcompile.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
common = bench_cli._bench("common")
report = bench_cli._bench("report")
stage_profile = bench_cli._bench("stage_profile")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_prefill_stream_fills_the_cap_with_chunked_requests() -> None:
    stream = common.prefill_stream(64, 60, random.Random(3), isl=40)
    totals = [sum(lens) for lens in stream]
    assert all(32 <= t <= 64 for t in totals)
    assert 64 in totals and any(t < 64 for t in totals)  # full forwards and partial ones
    assert all(1 <= n <= 40 for lens in stream for n in lens)
    assert any(len(lens) > 1 for lens in stream)  # varlen: several sequences per forward
    assert stream == common.prefill_stream(64, 60, random.Random(3), isl=40)
    with pytest.raises(ValueError, match="prefill_stream"):
        common.prefill_stream(1, 4, random.Random(0), isl=40)


def test_union_length_merges_overlaps_and_clips_to_the_window() -> None:
    intervals = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]
    assert stage_profile.union_length(intervals, (0.0, 10.0)) == 4.0
    assert stage_profile.union_length(intervals, (2.5, 5.5)) == 1.0
    assert stage_profile.union_length([], (0.0, 1.0)) == 0.0


def test_markdown_sections_replace_only_their_own_text(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    report.update_markdown_section(doc, "prefill-cpu", "first figures")
    doc.write_text(doc.read_text() + "\n## Compile time\n\nanother engineer's table\n")
    report.update_markdown_section(doc, "prefill-gpu", "gpu figures")
    report.update_markdown_section(doc, "prefill-cpu", "second figures")
    text = doc.read_text()
    assert text.startswith("# Benchmarks")
    assert "second figures" in text and "first figures" not in text
    assert "another engineer's table" in text and "gpu figures" in text
    assert text.count("<!-- prefill-cpu:start -->") == 1


def test_suite_overrides_from_the_command_line() -> None:
    parser = argparse.ArgumentParser()
    common.add_suite_arguments(parser)
    argv = ["--suite", "smoke", "--device", "cpu", "--hidden", "256", "--experts", "4", "--repeats", "2"]
    suite = common.suite_from_args(parser.parse_args(argv))
    cfg = suite.stage.model_config()
    assert (cfg.hidden_size, cfg.num_experts, suite.repeats) == (256, 4, 2)
    assert cfg.num_heads * cfg.head_dim == 256
    assert suite.caps == (8, 16, 32, 64, 128) and suite.capture_cap == 32
    with pytest.raises(ValueError, match="unknown benchmark path"):
        common.parse_paths("eager,nope", torch.device("cpu"))
    assert [p.name for p in common.parse_paths("ppb,torch-ro", torch.device("cpu"))] == ["eager", "ppb"]


def test_a_failing_path_is_dropped_with_its_reason_and_the_others_still_run() -> None:
    bad = common.PathSpec("bad", "bad options", "pp_breakable", {"graph_mode": "bogus"})
    spec = common.StageSpec(preset="tiny", layers=2, pp_size=2, pp_rank=1)
    harness = common.StageHarness(spec, [common.PATHS["eager"], bad, common.PATHS["ppb"]], capture_cap=32)
    batches = [harness.batch(lens, seed=i) for i, lens in enumerate([[5, 7], [20], [3]])]
    assert [harness.warm_up(n, batches) for n in list(harness.modules)] == [True, False, True]
    assert list(harness.modules) == ["eager", "ppb"]
    assert "graph_mode" in harness.failed["bad"] and "bogus" in harness.failed["bad"]
    assert harness.max_diffs["ppb"] < 1e-4  # the measured path computes what eager computes
    assert harness.graph_mode("ppb") == "emulate"  # a graph path: emulated on CPU, not "auto"'s live size


def test_throughput_compiles_no_path_but_eager_past_its_deadline() -> None:
    """A time-boxed run (bench/gpu_check.sh) still ends with figures: paths left when the budget runs out
    are dropped, with the reason, instead of compiling past it."""
    tp = bench_cli._bench("prefill_throughput")
    suite = common.SUITES["smoke"]
    harness = common.make_harness(suite)
    result = tp.run_throughput(harness, suite, deadline=time.monotonic() - 1.0)
    assert list(harness.modules) == ["eager"]
    assert set(result["failed"]) == {"ppb", "ppb-static"}
    assert all("time budget" in why for why in result["failed"].values())
    assert [r["cap"] for r in result["rows"]] == list(suite.caps)


def test_bench_command_runs_every_benchmark_and_writes_the_docs(tmp_path: Path) -> None:
    out, docs = tmp_path / "results", tmp_path / "docs" / "benchmarks.md"
    rc = main(["bench", "--suite", "smoke", "--device", "cpu", "--out", str(out), "--docs-file", str(docs)])
    assert rc == 0

    tp = json.loads((out / "throughput.json").read_text())
    assert [r["cap"] for r in tp["rows"]] == [8, 16, 32, 64, 128]
    capture_cap = tp["suite"]["capture_cap"]
    modes = {p["name"]: p["graph_mode"] for p in tp["paths"]}
    assert modes == {"eager": "-", "ppb": "emulate", "ppb-static": "eager"}  # the graph paths, on CPU
    # Each pp_breakable path's own captures (the paths share one stage module): the same ladder each.
    captures = {p["name"]: p["capture"] for p in tp["paths"]}
    assert captures["eager"] is None
    for name in ("ppb", "ppb-static"):
        assert captures[name]["graphs"] > 0 and captures[name]["seconds"] >= 0, captures
        assert captures[name]["measured_bytes"] is None  # CUDA only
    assert captures["ppb"] == {**captures["ppb-static"], "seconds": captures["ppb"]["seconds"]}
    for row in tp["rows"]:
        assert set(row["tok_s"]) == {"eager", "ppb", "ppb-static"}
        assert all(v > 0 for v in row["tok_s"].values()) and row["ratio"]["eager"] == 1.0
        assert len(row["tokens"]) == row["forwards"] and max(row["tokens"]) <= row["cap"]
        on_bucket = sum(t <= capture_cap for t in row["tokens"])  # above the cap: eager by policy
        assert row["served"]["ppb"] == f"{on_bucket}/{row['forwards']}"
        assert row["served"]["ppb-static"] == f"{on_bucket}/{row['forwards']}"

    prof = json.loads((out / "profile.json").read_text())
    assert set(prof["rows"]) == {"eager", "ppb", "ppb-static"}
    for r in prof["rows"].values():
        assert 0 < r["busy_ms"] <= r["wall_ms"] and r["wall_over_busy"] >= 1.0

    ov = json.loads((out / "overhead.json").read_text())
    assert (ov["segments"], ov["graph_segments"]) == (5, 3)  # 2 layers: 3 graph segments, 2 attention breaks
    assert ov["eager_ops"] > 0 and "segment bodies" in ov["parts_us"] and ov["graph_mode"] == "emulate"
    assert ov["noop_hot_us"] > 0 and ov["noop_us"] > 0
    copy_in, bridges = ov["part_profile"]["copy-in"], ov["part_profile"]["bridge copies"]
    assert copy_in["calls"] == 2 and bridges["calls"] == 2  # ids and positions; one per attention break
    assert "aten::copy_" in {name for name, _ in copy_in["ops"]} and copy_in["host_us"] > 0
    assert ov["graph_launch"] is None  # CUDA only

    text = docs.read_text()
    for key in ("prefill", "prefill-cpu", "prefill-gpu"):
        assert f"<!-- {key}:start -->" in text
    assert "| cap (seed cap) |" in text and "wall/busy" in text and "per segment" in text
    assert "Not measured yet" in text  # the GPU section is a placeholder until a GPU run is rendered
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (docs.parent / "benchmarks" / "prefill_throughput_cpu.png").stat().st_size > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_gpu_check_without_cuda_says_so_and_exits_cleanly(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "gpu")}
    result = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "no CUDA device" in result.stdout
    assert not (tmp_path / "gpu").exists()


def test_bench_from_an_installed_wheel_says_how_to_run_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Installed from a wheel there is no bench/ beside the package: the command says where to run it."""
    from ppcompile.cli import bench as bench_cli
    from ppcompile.cli.main import main

    monkeypatch.setattr(bench_cli, "REPO_ROOT", tmp_path)
    with pytest.raises(SystemExit, match="source checkout"):
        main(["bench", "--quick"])

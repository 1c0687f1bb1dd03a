"""``report.json``: written at compile, rewritten after capture and at exit; its facts match the runtime's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from debug_helpers import SIZES, compile_stage, read_report

import ppcompile
from ppcompile.debug import build_report, capture_records, load_reports
from ppcompile.debug.report import refresh_reports
from ppcompile.passes.manager import PASSES


def test_report_before_and_after_capture(tmp_path: Path) -> None:
    stage = compile_stage({"dump_dir": str(tmp_path)})
    stage.call(40)  # above the cap: compiled, runs eagerly, nothing captured yet
    rt = stage.runtime
    folder = tmp_path / rt.name
    before = read_report(str(folder))
    assert before["captures"] == {"count": 0, "runs": [], "captured": False}
    assert before["memory"]["captured_output_bytes"] is None
    with ppcompile.counters.expect(captures=2 * len(SIZES), replays=1):
        stage.call(10)  # bucket 16: captures every (graph segment, bucket)
    after = read_report(str(folder))
    assert after["captures"]["count"] == 2 * len(SIZES) and after["captures"]["captured"]
    (run,) = after["captures"]["runs"]
    assert sorted(b["bucket"] for b in run["buckets"]) == SIZES and run["failed"] is None
    assert all(b["graphs"] == 2 and b["seconds"] >= 0 for b in run["buckets"])
    assert run["measured_bytes"] is None  # CPU: no CUDA pool to measure
    written = after.pop("written")
    assert after == json.loads(json.dumps(build_report(rt)))  # the file is the runtime's current report
    assert before["written"]["after"] == "compile" and written["after"] == "capture"


def test_report_counts_every_forward_once_refreshed(tmp_path: Path) -> None:
    """Written at capture, the report counts the forward that captured; ``refresh_reports`` (run at exit)
    brings it up to date, and each file says when and after what it was written."""
    stage = compile_stage({"dump_dir": str(tmp_path)})
    for n in (10, 11, 12, 13, 14, 15):
        stage.call(n)
    folder = str(tmp_path / stage.runtime.name)
    stale = read_report(folder)
    assert stale["traffic"]["forwards"] == 1 and stale["written"]["after"] == "capture"
    assert str(folder) in refresh_reports()
    fresh = read_report(folder)
    assert fresh["traffic"]["forwards"] == 6 and fresh["written"]["after"] == "request"
    assert fresh["written"]["at"] >= stale["written"]["at"]
    assert refresh_reports() == []  # nothing served since: nothing rewritten


def test_report_is_rewritten_at_exit(tmp_path: Path) -> None:
    """A process that serves six forwards leaves a report that says six, written at exit."""
    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from debug_helpers import compile_stage
stage = compile_stage({{"dump_dir": {str(tmp_path)!r}}})
for n in (10, 11, 12, 13, 14, 15):
    stage.call(n)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    ((_, report),) = load_reports(str(tmp_path))
    assert report["traffic"]["forwards"] == 6 and report["written"]["after"] == "exit"


def test_report_describes_segments_buffers_and_buckets(tmp_path: Path) -> None:
    stage = compile_stage({"dump_dir": str(tmp_path)})
    stage.call(10)
    rt = stage.runtime
    r = read_report(str(tmp_path / rt.name))
    assert r["stage_graph"] == rt.name and r["graph_mode"] == "emulate" and r["rank"] is None
    assert r["layer_ids"] == [1] and r["eager_reason"] is None
    segs = r["segments"]
    assert [(s["name"], s["kind"], s["nodes"]) for s in segs] == [
        (s.name, s.kind, s.num_nodes) for s in rt.segments
    ]
    brk = segs[1]
    assert brk["layer_ids"] == [1] and brk["break_reason"]["kind"] == "attention"
    assert brk["break_reason"]["op"] == "ppcompile.attention"
    assert "layers.py" in brk["break_reason"]["stack_trace"]  # the user's source line
    assert brk["writes_static"] and brk["writes_static"][0] in segs[2]["reads_static"]
    program = rt.program
    specs = {b.name: b for b in (*program.input_buffers.values(), *program.bridge_buffers.values())}
    assert {b["name"] for b in r["static_buffers"]} == set(specs)
    for b in r["static_buffers"]:
        spec = specs[b["name"]]
        assert b["shape"] == list(spec.shape) and b["shape"][0] == max(SIZES)
        assert b["dtype"] == str(spec.dtype).removeprefix("torch.") and b["bytes"] == spec.nbytes
    buckets = r["buckets"]
    assert buckets["sizes"] == SIZES and buckets["cap"] == 32
    assert buckets["table"] == [[n, b, round(w, 4)] for n, b, w in rt.plan.padding_table()]
    assert buckets["summary"]["eager_at_or_below_cap"] == 1  # 1 token: bucket 4 pads more than 2x
    assert buckets["per_bucket"][1] == {"bucket": 8, "serves": [5, 8], "max_waste": 0.6}
    assert list(r["pass_times_ms"]) == [p.__name__ for p in PASSES]


def test_memory_estimate_matches_what_capture_holds(tmp_path: Path) -> None:
    """The estimate of graph outputs (the largest bucket's: the others share its memory) equals the
    bytes the emulated graphs hold."""
    stage = compile_stage({"dump_dir": str(tmp_path)})
    stage.call(10)
    rt = stage.runtime
    mem = read_report(str(tmp_path / rt.name))["memory"]
    (record,) = capture_records(rt)
    assert mem["graph_output_bytes"] == mem["captured_output_bytes"] == record.output_bytes > 0
    assert mem["static_buffer_bytes"] == sum(
        b.nbytes for b in (*rt.program.input_buffers.values(), *rt.program.bridge_buffers.values()))
    assert mem["estimated_graph_bytes"] == (
        mem["static_buffer_bytes"] + mem["graph_output_bytes"] + mem["transient_bytes"])
    assert mem["transient_bytes"] > 0
    by_bucket = {b.bucket: b.output_bytes for b in record.buckets}
    assert by_bucket[max(SIZES)] == record.output_bytes  # smaller buckets add nothing
    assert all(by_bucket[b] == 0 for b in SIZES if b != max(SIZES))


def test_each_module_instance_records_a_capture_run(tmp_path: Path) -> None:
    """Two instances of one stage share Dynamo's graph but capture their own graphs."""
    first = compile_stage({"dump_dir": str(tmp_path)})
    first.call(10)
    second = compile_stage({"dump_dir": str(tmp_path)})
    second.call(12)
    rt = first.runtime
    assert second.runtime is rt and len(capture_records(rt)) == 2
    assert read_report(str(tmp_path / rt.name))["captures"]["count"] == 4 * len(SIZES)


def test_always_eager_stage_has_no_memory_estimate(tmp_path: Path) -> None:
    stage = compile_stage({"dump_dir": str(tmp_path)})
    stage.compiled = torch.compile(stage.module, backend="pp_breakable", dynamic=False,
                                   options={"capture_sizes": SIZES, "graph_mode": "emulate",
                                            "dump_dir": str(tmp_path)})
    stage.call(10)
    r = read_report(str(tmp_path / stage.runtime.name))
    assert "concrete token sizes" in r["eager_reason"]
    assert r["memory"]["estimated_graph_bytes"] is None and r["captures"]["count"] == 0


def test_load_reports(tmp_path: Path) -> None:
    stage = compile_stage({"dump_dir": str(tmp_path)})
    stage.call(10)
    (path, report), = load_reports(str(tmp_path))
    assert path.endswith("report.json") and report["stage_graph"] == stage.runtime.name
    assert load_reports(path) == [(path, report)]
    bad = tmp_path / "other.json"
    bad.write_text('{"schema": "something else"}')
    with pytest.raises(ValueError, match="not a ppcompile stage report"):
        load_reports(str(bad))
    with pytest.raises(FileNotFoundError):
        load_reports(str(tmp_path / "missing"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_report_has_measured_memory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ppcompile.__main__ import main

    assert main(["dump", "--stage", "1/4", "--model", "tiny", "--out", str(tmp_path), "--capture-sizes",
                 "8,16,32", "--tokens", "12", "--device", "cuda"]) == 0
    ((_, r),) = load_reports(str(tmp_path))
    assert r["graph_mode"] == "cuda" and r["captures"]["count"] == 6
    mem = r["memory"]
    assert mem["measured_graph_bytes"] is not None and mem["measured_graph_bytes"] >= 0
    # The largest bucket's outputs, then whatever of the smaller buckets' the pool placed apart from them
    # (where a block is reused depends on the allocator): between the estimate and no sharing at all.
    buckets = len(r["captures"]["runs"][0]["buckets"])
    assert mem["graph_output_bytes"] <= mem["captured_output_bytes"] <= buckets * mem["graph_output_bytes"]
    assert all(b["pool_bytes"] is not None for b in r["captures"]["runs"][0]["buckets"])
    assert "measured (CUDA) -" not in capsys.readouterr().out  # the table prints the measured bytes

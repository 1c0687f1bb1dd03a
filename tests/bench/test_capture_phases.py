"""``bench/capture_phases.py``: a CUDA graph executor whose captures are timed phase by phase, run on
the strict CUDA double (``tests/cuda_double.py``), and ``bench/lazy_capture.py``'s rows that report it."""

from __future__ import annotations

import pytest
import torch
from cuda_double import StrictCuda

from ppcompile.cli import bench as bench_cli
from ppcompile.runtime.executors import EmulatedGraphExecutor
from ppcompile.runtime.group_agreement import LOCAL

capture_phases = bench_cli._bench("capture_phases")
lazy_capture = bench_cli._bench("lazy_capture")


def test_each_capture_of_a_cuda_executor_is_timed_phase_by_phase_and_still_replays() -> None:
    double = StrictCuda()
    phases = capture_phases.CapturePhases(cuda=double)
    executor = phases.executor("cuda", False, torch.device("cpu"), LOCAL)
    x = torch.randn(4, 8)
    with executor.capture_session():
        for i in range(3):
            executor.capture((i, 8), lambda t, k=i: (t * 2 + k,), [x])
    assert phases.graphs == 3 and len(double.graphs) == 3
    per_graph = phases.ms_per_graph()
    assert list(per_graph) == list(capture_phases.PHASES)
    assert all(ms >= 0 for ms in per_graph.values()) and per_graph["warm-ups"] > 0
    x.copy_(torch.ones(4, 8))
    (out,) = executor.replay((2, 8), [x])
    torch.testing.assert_close(out, torch.full((4, 8), 4.0))  # the captured graph, replayed


def test_other_graph_modes_get_their_default_executor_untimed() -> None:
    phases = capture_phases.CapturePhases(cuda=StrictCuda())
    assert isinstance(phases.executor("emulate", False, None, LOCAL), EmulatedGraphExecutor)
    assert phases.ms_per_graph() == {}


@pytest.mark.usefixtures("fresh_dynamo")
def test_lazy_capture_rows_say_capture_ms_per_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lazy_capture, "REFERENCE", lazy_capture.REFERENCE.replace(num_layers=2))
    monkeypatch.setattr(lazy_capture, "PLANNED", [16, 64])
    rows = {r["policy"]: r for r in lazy_capture.run_policies("cpu")}
    assert rows["all"]["graphs"] == rows["all"]["first_captures"] == 3 * rows["all"]["buckets"]
    assert rows["planned, all"]["graphs"] == 3 * 2
    for row in rows.values():
        assert row["capture_ms_per_graph"] > 0 and row["capture_s"] > 0
        assert row["phases_ms_per_graph"] == {}  # phases are CUDA's; the CPU emulates graphs

"""``bench/graph_launch.py``: CUDA only; its lines for the overhead section, from a result of each kind."""

from __future__ import annotations

import pytest
import torch

from ppcompile.cli import bench as bench_cli

graph_launch = bench_cli._bench("graph_launch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA answer")
def test_without_cuda_nothing_is_measured_or_written() -> None:
    assert graph_launch.compare_launches("cpu") is None
    assert graph_launch.markdown_lines(None) == []


def test_lines_name_both_launches_per_graph_size_and_a_count_that_went_wrong() -> None:
    result = {"round": 200, "rounds": 15, "rows": [
        {"kernels": 1, "replay_us": 4.25, "launch_us": 2.5, "ran_as_expected": True},
        {"kernels": 16, "replay_us": 5.0, "launch_us": 3.125, "ran_as_expected": False}]}
    (line,) = graph_launch.markdown_lines(result)
    assert "1 kernel(s): `CUDAGraph.replay()` 4.25 µs, `cudaGraphLaunch` 2.50 µs;" in line
    assert "16 kernel(s)" in line and line.endswith("(COUNT MISMATCH).")
    skipped = graph_launch.markdown_lines({"skipped": "cuda.bindings not importable (x)"})
    assert skipped == ["Direct graph launch: not measured (cuda.bindings not importable (x))."]

"""Host time of launching one captured CUDA graph: ``CUDAGraph.replay()`` against ``cudaGraphLaunch`` of
its instantiated executable called through ``cuda.bindings`` (CUDA's Python bindings), for graphs of 1
and 16 kernels.

Whether torch's replay wrapper is a large part of a replay decides if a direct launch is worth keeping in
the runtime (issue 51); vLLM and SGLang replay through ``CUDAGraph.replay()``, SGLang's deduplicated runner
through ``cudaGraphLaunch``. Host time only: launches are timed in rounds of :data:`ROUND` calls with the
device synchronised between rounds (untimed), so the launch queue never fills and blocks the host.
Medians over rounds, µs per launch.

CUDA only (``compare_launches`` returns None on another device); ``cuda.bindings`` missing is reported,
not an error. Run alone: ``python bench/graph_launch.py``.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import median, sync

__all__ = ["compare_launches", "markdown_lines"]

ROUND = 200  # launches between two synchronisations
KERNELS = (1, 16)  # kernels per captured graph


def _per_call_us(launch: Callable[[], Any], device: torch.device, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        sync(device)
        start = time.perf_counter()
        for _ in range(ROUND):
            launch()
        times.append((time.perf_counter() - start) / ROUND)
    sync(device)
    return 1e6 * median(times)


def _graph(kernels: int, device: torch.device) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    x = torch.zeros(64, device=device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            x.add_(1)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            x.add_(1)
    return graph, x


def compare_launches(device: torch.device | str = "cuda", rounds: int = 15) -> dict[str, Any] | None:
    """Per graph size: µs of host time per ``CUDAGraph.replay()`` and per direct ``cudaGraphLaunch`` (None
    without CUDA; ``{"skipped": why}`` without ``cuda.bindings``). Both are checked to run the graph: a
    counter the graph increments reaches the launches' count."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        from cuda.bindings import runtime as cudart
    except ImportError as e:
        return {"skipped": f"cuda.bindings not importable ({e})"}
    try:
        return _compare(cudart, device, rounds)
    except Exception as e:  # the bindings' API differs from the one this was written against
        return {"skipped": f"direct launch failed: {type(e).__name__}: {e}"}


def _compare(cudart: Any, device: torch.device, rounds: int) -> dict[str, Any]:
    rows = []
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        raw_stream = cudart.cudaStream_t(init_value=stream.cuda_stream)
        for kernels in KERNELS:
            graph, x = _graph(kernels, device)
            graph.replay()
            executable = cudart.cudaGraphExec_t(init_value=graph.raw_cuda_graph_exec())
            (err,) = cudart.cudaGraphLaunch(executable, raw_stream)
            if err != cudart.cudaError_t.cudaSuccess:
                return {"skipped": f"cudaGraphLaunch failed: {err}"}
            sync(device)
            x.zero_()
            replay_us = _per_call_us(graph.replay, device, rounds)
            launch = functools.partial(cudart.cudaGraphLaunch, executable, raw_stream)
            launch_us = _per_call_us(launch, device, rounds)
            expected = 2 * rounds * ROUND * kernels
            ran = int(x[0].item())
            rows.append({"kernels": kernels, "replay_us": replay_us, "launch_us": launch_us,
                         "ran_as_expected": ran == expected})
            del graph
    return {"rows": rows, "round": ROUND, "rounds": rounds}


def markdown_lines(result: dict[str, Any] | None) -> list[str]:
    """Lines for the overhead section (none without CUDA)."""
    if result is None:
        return []
    if "skipped" in result:
        return [f"Direct graph launch: not measured ({result['skipped']})."]
    parts = [f"{r['kernels']} kernel(s): `CUDAGraph.replay()` {r['replay_us']:.2f} µs, `cudaGraphLaunch` "
             f"{r['launch_us']:.2f} µs" + ("" if r["ran_as_expected"] else " (COUNT MISMATCH)")
             for r in result["rows"]]
    return [f"Host time per graph launch (medians of {result['rounds']} rounds of {result['round']}): "
            + "; ".join(parts) + "."]


def main() -> int:
    result = compare_launches()
    print(json.dumps(result, indent=2) if result else "graph_launch: no CUDA device")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Startup with ``capture="all"`` vs ``capture="lazy"`` vs a planned ladder, on the reference 32-layer stage.

The whole reference decoder (hidden 16, 32 layers) on one rank, default capture ladder (74 buckets up to
8192) or a planned one; each policy in a fresh Dynamo state. Per policy: graphs captured and wall time of
the first forward (compile + capture + run), of a second forward at another bucket, and graph memory
(CUDA: the caching allocator's reserved-bytes growth; CPU: the runtime's static bytes). On a GPU the
``all`` row also says where each graph's capture time goes (``capture_phases.py``: warm-ups, capture
begin, recording, capture end, the replay after it, and the runtime around the executor), in ms per graph.

Run alone: ``python bench/lazy_capture.py [--device cpu|cuda]``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import ppcompile
from bench.capture_phases import CapturePhases
from ppcompile.config import graph_path_mode
from ppcompile.models import ModelConfig, make_batch, make_forward_context, make_stage, set_forward_context

__all__ = ["run_policies"]

REFERENCE = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=32, num_heads=2,
                        num_kv_heads=1, head_dim=8, max_position=64)
PLANNED = [16, 64, 256, 1024]  # a 4-bucket ladder, as a plan for short-prompt traffic might give


def _forward(compiled: Any, cfg: ModelConfig, lens: list[int], device: str, first: bool) -> float:
    ids, pos, proxies = make_batch(cfg, lens, 0, 1, seed=len(lens))
    ids, pos = ids.to(device), pos.to(device)
    if first:
        ppcompile.mark_token_dynamic(ids, pos)
    start = time.perf_counter()
    with torch.inference_mode(), set_forward_context(make_forward_context(lens, cfg, range(cfg.num_layers),
                                                                         device=device)):
        compiled(ids, pos, proxies)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run_policies(device: str, on_row: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """One row per policy; ``on_row`` gets each as soon as it is measured (a cut-off run keeps them)."""
    rows = []
    policies: list[tuple[str, dict[str, Any]]] = [("all", {}), ("lazy", {"capture": "lazy"}),
                ("planned, all", {"capture_sizes": PLANNED})]
    for name, options in policies:
        phases = CapturePhases()
        with phases.install() if name == "all" else contextlib.nullcontext(phases):
            rows.append(_policy_row(name, options, device, phases))
        if on_row is not None:
            on_row(rows[-1])
    return rows


def _policy_row(name: str, options: dict[str, Any], device: str, phases: CapturePhases) -> dict[str, Any]:
    """One policy in a fresh Dynamo state: its first and second forward, graphs, memory, capture time."""
    torch._dynamo.reset()
    stage = make_stage(REFERENCE, 0, 1).to(device)
    # Capture is the graph path's ("auto" would run a CPU stage at the live size, capturing nothing).
    backend_options = {"graph_mode": graph_path_mode(torch.device(device).type), **options}
    compiled = torch.compile(stage, backend="pp_breakable", options=backend_options)
    reserved = 0
    if device == "cuda":  # the previous row's graphs and buffers are freed now, not during this row
        gc.collect()
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved()
    before = ppcompile.counters.captures
    first = _forward(compiled, REFERENCE, [5, 6], device, first=True)
    first_captures = ppcompile.counters.captures - before
    second = _forward(compiled, REFERENCE, [40, 30], device, first=False)
    runtime = ppcompile.stage_runtimes()[-1]
    memory = (torch.cuda.memory_reserved() - reserved) if device == "cuda" else runtime.static_bytes()
    second_captures = ppcompile.counters.captures - before - first_captures
    capture_s = sum(r.seconds for r in runtime.capture_records())
    graphs = sum(r.graphs for r in runtime.capture_records())
    per_graph = phases.ms_per_graph()
    if per_graph:  # the runtime's own time per graph: capture runs minus the executor's calls
        per_graph["runtime around the executor"] = 1e3 * capture_s / graphs - sum(per_graph.values())
    return {"policy": name, "buckets": len(runtime.plan.sizes), "first_captures": first_captures,
            "first_s": first, "second_captures": second_captures, "second_s": second,
            "memory_bytes": memory, "capture_s": capture_s, "graphs": graphs,
            "capture_ms_per_graph": 1e3 * capture_s / graphs if graphs else None,
            "phases_ms_per_graph": per_graph}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| policy | buckets | graphs captured by the 1st forward | 1st forward s | graphs captured by "
          "the 2nd (other bucket) | 2nd forward s | capture ms per graph | graph memory MiB |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    phases: list[str] = []

    def show(r: dict[str, Any]) -> None:
        per_graph = "-" if r["capture_ms_per_graph"] is None else f"{r['capture_ms_per_graph']:.2f}"
        memory = r["memory_bytes"] / 2**20
        print(f"| {r['policy']} | {r['buckets']} | {r['first_captures']} | {r['first_s']:.2f} | "
              f"{r['second_captures']} | {r['second_s']:.3f} | {per_graph} | {memory:.1f} |", flush=True)
        if r["phases_ms_per_graph"]:
            parts = ", ".join(f"{k} {v:.3f}" for k, v in r["phases_ms_per_graph"].items())
            phases.append(f"Capture of the {r['policy']!r} row, host ms per graph: {parts}.")

    run_policies(args.device, on_row=show)
    for line in phases:
        print("\n" + line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What owned outputs (the default) cost per forward against views into graph memory
(``owned_outputs=False``), on a middle PP stage of the reference model.

A middle stage returns its proxies (``hidden_states``, ``residual``): with owned outputs each graph-path
forward copies both out of graph memory. Per token count, medians of interleaved forwards (device work
synchronised) of the two paths, and the copy alone (cloning the views path's outputs, synchronised), as a
share of the views path's wall time. The copy alone is the robust figure: the difference of two medians
of a forward is within noise on a shared machine.

Run alone: ``python bench/owned_outputs.py [--device cpu|cuda] [--tokens 16,2048] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import PATHS, PathSpec, StageHarness, StageSpec, median, sync
from bench.report import describe_machine, machine_info, markdown_table, save_json

__all__ = ["markdown", "run_owned_outputs"]

VIEWS = PathSpec("ppb-views", "pp_breakable (graphs, views: owned_outputs=False)", "pp_breakable",
                 {"segment_compiler": "eager", "owned_outputs": False}, graphs=True)
TARGET_SHARE_AT_2K = 0.01  # the bound on the default's cost at the 2K cap


def _tensors(out: Any) -> list[torch.Tensor]:
    values = out.values() if hasattr(out, "values") else out if isinstance(out, (tuple, list)) else [out]
    return [t for t in values if isinstance(t, torch.Tensor)]


def _time(fn: Any, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def run_owned_outputs(spec: StageSpec, tokens: list[int], rounds: int = 7, calls: int = 10
                      ) -> dict[str, Any]:
    """Per token count: wall per forward of the owned (default) and views paths, and the copy alone."""
    torch._dynamo.reset()
    harness = StageHarness(spec, [PATHS["eager"], PATHS["ppb"], VIEWS], capture_cap=max(tokens))
    batches = {n: harness.batch([n], seed=n) for n in tokens}
    for name in ("ppb", VIEWS.name):
        if not harness.warm_up(name, list(batches.values())):
            raise RuntimeError(f"path {name} failed: {harness.failed[name]}")
    rows = []
    with torch.inference_mode():
        for n, batch in batches.items():
            samples: dict[str, list[float]] = {"owned": [], "views": [], "copy": []}
            gc.collect()
            gc.disable()  # a collection inside one forward is noise here
            try:
                for _ in range(rounds):  # interleaved: a noisy neighbour hits every variant
                    for _ in range(calls):
                        samples["owned"].append(harness.time_forward("ppb", batch))
                        samples["views"].append(harness.time_forward(VIEWS.name, batch))
                        outs = _tensors(harness.call(VIEWS.name, batch))
                        samples["copy"].append(_time(lambda outs=outs: [t.clone() for t in outs],
                                                     harness.device))
            finally:
                gc.enable()
            owned, views, copy = (median(samples[k]) for k in ("owned", "views", "copy"))
            outs = _tensors(harness.call(VIEWS.name, batch))
            rows.append({"tokens": n, "owned_ms": 1e3 * owned, "views_ms": 1e3 * views,
                         "copy_us": 1e6 * copy, "copy_share": copy / views, "wall_ratio": owned / views,
                         "copied_bytes": sum(t.numel() * t.element_size() for t in outs)})
    return {"kind": "owned_outputs", "machine": machine_info(harness.device), "stage": spec.describe(),
            "graph_mode": harness.graph_mode("ppb"), "rows": rows, "max_diffs": harness.max_diffs}


def markdown(result: dict[str, Any]) -> str:
    head = ["tokens", "views ms/forward", "owned ms/forward", "owned / views", "copy alone (us)",
            "copy / views wall", "bytes copied"]
    rows = [[r["tokens"], f"{r['views_ms']:.3f}", f"{r['owned_ms']:.3f}", f"{r['wall_ratio']:.3f}",
             f"{r['copy_us']:.1f}", f"{100 * r['copy_share']:.2f}%", f"{r['copied_bytes']:,}"]
            for r in result["rows"]]
    return (f"{describe_machine(result['machine'])}. Stage: {result['stage']}; graphs: "
            f"{result['graph_mode']}.\n\n" + markdown_table(head, rows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", default="16,2048", help="token counts (one sequence each)")
    parser.add_argument("--hidden", type=int, default=None,
                        help="hidden size (default: 1024 on CUDA, the GPU suite's; 256 on CPU)")
    parser.add_argument("--layers", type=int, default=32, help="model layers (the stage has a quarter)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None, help="write owned_outputs.json here")
    args = parser.parse_args()
    cuda = torch.device(args.device).type == "cuda"
    hidden = args.hidden or (1024 if cuda else 256)
    if not cuda:
        torch.set_num_threads(1)
    spec = StageSpec(layers=args.layers, hidden=hidden, dtype="bfloat16" if cuda else None,
                     device=args.device)
    result = run_owned_outputs(spec, [int(t) for t in args.tokens.split(",")], rounds=args.rounds)
    if args.out:
        save_json(Path(args.out) / "owned_outputs.json", result)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Tiny-prefill latency of a stage whose attention is capturable: whole-stage graphs against the breakable
path (``whole_graph_tokens=0``) and eager, and what the whole graphs cost (graphs, memory).

The stage is the reference model's first stage of one (every layer, logits out) with
``ModelConfig(paged_attention=True)``: each forward writes its requests' KV and reads it through block
tables. Per (tokens, requests): the median wall of synchronised forwards, interleaved over the paths (a
noisy neighbour hits each alike), each path with caches of its own, and the largest difference of its
logits from eager's.

Run alone: ``python bench/whole_stage.py [--device cpu|cuda] [--tokens 1,16,64,256] [--requests 1,8]
[--out DIR]``. On CPU the graphs are the emulator's (``graph_mode="emulate"``): the figures there test the
script, they say nothing of the GPU.
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

import ppcompile
from bench.common import median, sync
from bench.report import describe_machine, machine_info, markdown_table, save_json
from ppcompile.models import ModelConfig, make_paged_batch, make_stage

__all__ = ["markdown", "run_whole_stage"]

PATHS = {"eager": None, "breakable": {"whole_graph_tokens": 0}, "whole": {}}


def _split(tokens: int, requests: int) -> list[int]:
    base, extra = divmod(tokens, requests)
    return [base + (1 if r < extra else 0) for r in range(requests)]


def _memory(device: torch.device) -> int:
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


def run_whole_stage(cfg: ModelConfig, device: torch.device, cases: list[tuple[int, int]], whole_tokens: int,
                    calls: int = 20, rounds: int = 5) -> dict[str, Any]:
    """Per case, ms per forward of each path and its largest logit difference from eager; per path, the
    graphs it captured and the device memory its captures reserved."""
    torch._dynamo.reset()
    mode = "cuda" if device.type == "cuda" else "emulate"
    buckets = sorted({16, 32, 64, 128, 256, 512, whole_tokens, *(n for n, _ in cases)})
    stages: dict[str, Any] = {}
    captured: dict[str, dict[str, Any]] = {}
    for name, extra in PATHS.items():
        stage = make_stage(cfg, 0, 1, device=device)
        if extra is None:
            stages[name] = stage
            continue
        options = {"capture_sizes": buckets, "graph_mode": mode, "whole_graph_tokens": whole_tokens,
                   "capture": "lazy", **extra}
        stages[name] = torch.compile(stage, backend="pp_breakable", dynamic=True, options=options)
    # The first call's sizes differ (Dynamo's duck shaping would tie the request and token counts).
    batches = {case: make_paged_batch(cfg, _split(*case), None, 0, 1, seed=case[0], device=device)
               for case in cases}
    rows = []
    with torch.inference_mode():
        for name, fn in stages.items():  # warm-up: compile, capture every case's bucket
            before, captures = _memory(device), ppcompile.counters.captures
            start = time.perf_counter()
            for ids, pos, _, meta in [make_paged_batch(cfg, [3, 2], None, 0, 1, device=device),
                                      *batches.values()]:
                fn(ids, pos, None, meta)
            sync(device)
            captured[name] = {"graphs": ppcompile.counters.captures - captures,
                              "memory": _memory(device) - before, "warm_s": time.perf_counter() - start}
        for case, (ids, pos, _, meta) in batches.items():
            samples: dict[str, list[float]] = {name: [] for name in stages}
            outs = {name: fn(ids, pos, None, meta) for name, fn in stages.items()}
            gc.collect()
            gc.disable()
            try:
                for _ in range(rounds):
                    for name, fn in stages.items():
                        for _ in range(calls):
                            sync(device)
                            start = time.perf_counter()
                            fn(ids, pos, None, meta)
                            sync(device)
                            samples[name].append(time.perf_counter() - start)
            finally:
                gc.enable()
            ms = {name: 1e3 * median(values) for name, values in samples.items()}
            diffs = {name: float((outs[name].float() - outs["eager"].float()).abs().max()) for name in stages}
            rows.append({"tokens": case[0], "requests": case[1], "ms": ms, "max_diff": diffs})
    return {"kind": "whole_stage", "machine": machine_info(device), "graph_mode": mode,
            "whole_graph_tokens": whole_tokens, "layers": cfg.num_layers, "hidden": cfg.hidden_size,
            "rows": rows, "captured": captured}


def markdown(result: dict[str, Any]) -> str:
    head = ["tokens", "requests", "eager ms", "breakable ms", "whole ms", "breakable / whole", "max |diff|"]
    rows = [[r["tokens"], r["requests"], *(f"{r['ms'][p]:.3f}" for p in PATHS),
             f"{r['ms']['breakable'] / r['ms']['whole']:.2f}x",
             f"{max(r['max_diff'].values()):.1e}"] for r in result["rows"]]
    graphs = "; ".join(f"{name}: {c['graphs']} graphs, {c['memory'] / 2**20:.1f} MiB, warm-up "
                       f"{c['warm_s']:.1f} s" for name, c in result["captured"].items() if name != "eager")
    return (f"{describe_machine(result['machine'])}. Stage: {result['layers']} layers, hidden "
            f"{result['hidden']}, paged attention; graphs: {result['graph_mode']}; whole_graph_tokens "
            f"{result['whole_graph_tokens']}.\n\n" + markdown_table(head, rows)
            + f"\n\nCaptured: {graphs}.\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", default=None,
                        help="token counts (default: 1,16,64,256 on CUDA; 1,16,64 on CPU)")
    parser.add_argument("--requests", default="1,8", help="requests per forward")
    parser.add_argument("--layers", type=int, default=None, help="default: 16 on CUDA, 4 on CPU")
    parser.add_argument("--hidden", type=int, default=None, help="default: 1024 on CUDA, 64 on CPU")
    parser.add_argument("--whole-tokens", type=int, default=256)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", default=None, help="write whole_stage.json here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    tokens = [int(t) for t in (args.tokens or ("1,16,64,256" if cuda else "1,16,64")).split(",")]
    requests = [int(r) for r in args.requests.split(",")]
    hidden = args.hidden or (1024 if cuda else 64)
    heads = max(4, hidden // 128)
    cfg = ModelConfig(num_layers=args.layers or (16 if cuda else 4), hidden_size=hidden,
                      intermediate_size=4 * hidden, num_heads=heads, num_kv_heads=max(2, hidden // 512),
                      head_dim=hidden // heads, paged_attention=True, block_size=16, blocks_per_request=32,
                      kv_blocks=8 * 32 + 32, dtype=torch.bfloat16 if cuda else torch.float32)
    cases = [(n, r) for n in tokens for r in requests if r <= n]
    result = run_whole_stage(cfg, device, cases, args.whole_tokens, calls=args.calls)
    if args.out:
        save_json(Path(args.out) / "whole_stage.json", result)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

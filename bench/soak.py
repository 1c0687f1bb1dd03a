"""Soak: many random forwards of compiled PP stages, every output compared to eager, memory watched.

Every reference-model contract (``small-dense``: hidden + residual proxies, ``small-moe``, ``hidden-only``,
``topk``: an int32 proxy) is split into ``--pp`` stages, each compiled with ``pp_breakable`` (default
capture ladder up to ``--cap``). Each forward picks a random contract, stage and token count (1, a
bucket exactly, a bucket + 1, above the cap, or uniform), runs the compiled and the eager stage on the
same inputs and compares every output (floats within ``--atol``, integers exactly). The output kept from
another random stage is compared again after each call (outputs are valid until the next call of the
*same* stage).

Reported at the start (after every stage has compiled and captured), the middle and the end:
static-buffer bytes (``StageRuntime.static_bytes`` over all runtimes) and the process's resident
memory; both must stay flat.
Exit status 1 on a mismatch, growth of static memory, or RSS growth above ``--rss-slack-mib``.

Run: ``python bench/soak.py [--forwards 10000] [--minutes 5] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import ppcompile
from ppcompile.config import graph_path_mode
from ppcompile.models import (
    REFERENCE_CONFIGS,
    make_batch,
    make_forward_context,
    make_stage,
    set_forward_context,
)
from ppcompile.pipeline.inprocess import STAGE_RECOMPILE_LIMIT
from ppcompile.runtime.buckets import default_capture_ladder
from ppcompile.torch_internals import raise_recompile_limit

CONTRACTS = ("small-dense", "small-moe", "hidden-only", "topk")


def rss_bytes() -> int:
    """Current resident set size (``/proc/self/statm``), or the peak where that is missing."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def static_bytes() -> int:
    return sum(rt.static_bytes() for rt in ppcompile.stage_runtimes())


class Soak:
    """The compiled and eager stages of every contract, and one random forward at a time."""

    def __init__(
        self, pp: int, cap: int, device: torch.device, atol: float, seed: int, options: Mapping[str, Any]
    ) -> None:
        self.pp, self.cap, self.device, self.atol = pp, cap, device, atol
        self.rng = random.Random(seed)
        self.buckets = default_capture_ladder(cap)
        self.stages: dict[tuple[str, int], tuple[torch.nn.Module, Any]] = {}
        for name in CONTRACTS:
            cfg = REFERENCE_CONFIGS[name]
            for rank in range(pp):
                module = make_stage(cfg, rank, pp, device)
                compiled = torch.compile(module, backend="pp_breakable", dynamic=True,
                                         options={"max_capture_tokens": cap, **options})
                self.stages[(name, rank)] = (module, compiled)
        self.kept: dict[tuple[str, int], tuple[Any, Any]] = {}
        self.max_err = 0.0
        self.forwards = 0

    def token_count(self) -> int:
        b = self.rng.choice(self.buckets)
        kind = self.rng.randrange(5)
        if kind == 0:
            return 1
        if kind == 1:
            return b
        if kind == 2:
            return b + 1
        if kind == 3:
            return self.cap + self.rng.randint(1, self.cap // 4 + 1)
        return self.rng.randint(1, self.cap)

    def run(self, key: tuple[str, int], n: int, seed: int, compiled: bool) -> Any:
        name, rank = key
        cfg = REFERENCE_CONFIGS[name]
        module, comp = self.stages[key]
        lens = [n] if n < 4 or seed % 3 == 0 else [n // 3, n - n // 3]
        ids, pos, proxies = make_batch(cfg, lens, rank, self.pp, seed=seed, device=self.device)
        ctx = make_forward_context(lens, cfg, range(module.start_layer, module.end_layer), device=self.device)
        with set_forward_context(ctx):
            return (comp if compiled else module)(ids, pos, pp_proxy_tensors=proxies)

    def compare(self, got: Any, want: Any, what: str) -> None:
        if isinstance(want, Mapping):
            if sorted(got) != sorted(want):
                raise AssertionError(f"{what}: keys {sorted(got)} != {sorted(want)}")
            for k in want:
                self.compare(got[k], want[k], f"{what}[{k}]")
            return
        if got.shape != want.shape:
            raise AssertionError(f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        if not want.is_floating_point():
            if not torch.equal(got, want):
                raise AssertionError(f"{what}: integer outputs differ")
            return
        err = float((got - want).abs().max()) if want.numel() else 0.0
        self.max_err = max(self.max_err, err)
        if not err <= self.atol:
            raise AssertionError(f"{what}: max abs error {err:.3g} > {self.atol}")

    def forward(self, key: tuple[str, int] | None = None, n: int | None = None) -> None:
        key = key or self.rng.choice(sorted(self.stages))
        n = n or self.token_count()
        seed = self.rng.randrange(2**31)
        got = self.run(key, n, seed, compiled=True)
        want = self.run(key, n, seed, compiled=False)
        self.compare(got, want, f"forward {self.forwards}: {key[0]} stage {key[1]} at {n} tokens")
        self.kept[key] = (got, want)
        other = self.rng.choice(sorted(self.kept))
        self.compare(*self.kept[other], f"forward {self.forwards}: kept output of {other}")
        self.forwards += 1


def snapshot(label: str, soak: Soak, start: float) -> dict[str, Any]:
    gc.collect()
    c = ppcompile.counters
    row = {
        "at": label,
        "forwards": soak.forwards,
        "seconds": round(time.perf_counter() - start, 1),
        "static_bytes": static_bytes(),
        "rss_bytes": rss_bytes(),
        "replays": c.replays,
        "eager_runs": c.eager_runs,
        "captures": c.captures,
        "backend_compiles": c.backend_compiles,
    }
    if soak.device.type == "cuda":
        row["cuda_allocated"] = int(torch.cuda.memory_allocated())
        row["cuda_reserved"] = int(torch.cuda.memory_reserved())
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    cols = [k for k in rows[0] if k != "at"]
    lines = ["| at | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for r in rows:
        cells = [f"{r[k] / 2**20:.1f} MiB" if k.endswith(("bytes", "allocated", "reserved")) else str(r[k])
                 for k in cols]
        lines.append(f"| {r['at']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--forwards", type=int, default=10_000)
    p.add_argument("--minutes", type=float, default=None, help="stop early after this long")
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--cap", type=int, default=128, help="max_capture_tokens of every stage")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--atol", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--debug", action="store_true", help="compile with debug=True (stale-output checks)")
    p.add_argument("--owned-outputs", action="store_true", help="compile with owned_outputs=True")
    p.add_argument("--graph-mode", default=None,
                   help="graph_mode of every stage (default: cuda on a GPU, else emulate: the graph path)")
    p.add_argument("--rss-slack-mib", type=float, default=32.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    raise_recompile_limit(STAGE_RECOMPILE_LIMIT)
    device = torch.device(args.device)
    start = time.perf_counter()
    with torch.inference_mode():
        options = {"graph_mode": args.graph_mode or graph_path_mode(device.type), "debug": args.debug,
                   "owned_outputs": args.owned_outputs}
        soak = Soak(args.pp, args.cap, device, args.atol, args.seed, options)
        for key in sorted(soak.stages):  # warm-up: every compile (1 token is its own graph) and capture
            for n in (5, 1, args.cap + 1):
                soak.forward(key, n)
        rows = [snapshot("start", soak, start)]
        deadline = start + args.minutes * 60 if args.minutes else None
        total = args.forwards
        while soak.forwards < total:
            soak.forward()
            if soak.forwards == total // 2:
                rows.append(snapshot("middle", soak, start))
            if deadline is not None and time.perf_counter() > deadline:
                total = soak.forwards
                break
        if len(rows) == 1:
            rows.append(snapshot("middle", soak, start))
        rows.append(snapshot("end", soak, start))
    print(markdown(rows))
    print(f"\n{soak.forwards} forwards compared to eager, max abs error {soak.max_err:.3g}; "
          f"{len(soak.stages)} compiled stages ({', '.join(CONTRACTS)} x PP{args.pp}); cap {args.cap}; "
          f"options {options}; "
          f"torch {torch.__version__} on {device.type}")
    problems = []
    if len({r["static_bytes"] for r in rows}) != 1:
        problems.append("static-buffer bytes changed over the run")
    growth = (rows[-1]["rss_bytes"] - rows[1]["rss_bytes"]) / 2**20
    if growth > args.rss_slack_mib:
        problems.append(f"RSS grew {growth:.1f} MiB from the middle to the end")
    if args.json:
        result = {"rows": rows, "forwards": soak.forwards, "max_abs_error": soak.max_err,
                  "problems": problems}
        args.json.write_text(json.dumps(result, indent=2))
    for msg in problems:
        print(f"FAIL: {msg}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

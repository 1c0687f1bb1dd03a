"""Prefill-only throughput of one PP stage: eager against ``pp_breakable`` (and, on a GPU, torch's
``mode="reduce-overhead"``), at the seed's aggregate caps 2K..32K (divided by a scale on CPU).

For each cap a stream of varlen prefill forwards is built once (see ``common.prefill_stream``); every
path runs the same stream, interleaved forward by forward in one process (the order of paths
rotates), ``repeats`` times; tokens/s is the stream's tokens over the sum of each forward's median
time. ``pp_breakable`` captures the
default ladder up to 8192 / scale tokens, so at the two largest caps it runs eagerly by policy, as the
seed does above 8K.

Run alone: ``python bench/prefill_throughput.py [--suite cpu-quick] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    Batch,
    StageHarness,
    Suite,
    add_suite_arguments,
    apply_threads,
    make_harness,
    median,
    prefill_stream,
    suite_from_args,
)
from bench.report import describe_machine, machine_info, markdown_table, not_measured, save_json
from ppcompile.counters import counters

__all__ = ["markdown", "plot", "run_throughput"]

log = logging.getLogger(__name__)

CPU_NOTE = (
    "On CPU, graphs are *emulated*: a replay re-runs the segment's ops and copies the results into the "
    "captured outputs, so `pp_breakable` cannot beat eager through graphs there; the CPU columns show "
    "the runtime's cost (copy-in, padding to the bucket, emulation copies) and, with Inductor segments, "
    "what fusing the segments buys. `ppb-static` is the same static-buffer path with the graph "
    "emulation off. Launch savings only exist with real CUDA graphs."
)


def build_streams(harness: StageHarness, suite: Suite, seed: int) -> dict[int, list[Batch]]:
    """The stream of each cap, inputs and forward contexts built ahead of timing."""
    streams = {}
    for i, cap in enumerate(suite.caps):
        rng = random.Random(seed * 1000 + i)
        lens = prefill_stream(cap, suite.forwards, rng, suite.isl)
        streams[cap] = [harness.batch(x, seed=seed + j) for j, x in enumerate(lens)]
    return streams


def run_throughput(
    harness: StageHarness,
    suite: Suite,
    seed: int = 0,
    on_repeat: Callable[[dict[str, Any]], None] | None = None,
    deadline: float | None = None,
) -> dict[str, Any]:
    """Measures tokens/s of every path at every cap; returns the JSON-able result.

    Paths are interleaved forward by forward (the order rotates), so a noisy neighbour slows every
    path alike. A path's tokens/s is the stream's tokens over the sum of its forwards' median times
    (a preempted forward costs one sample, not a whole run); ``runs`` keeps each run's own tokens/s.
    ``deadline`` (a ``time.monotonic()`` value): no path but eager starts its compile after it (the
    others are dropped, the reason in ``failed``) and no new repeat starts after it (at least one runs),
    so a time-boxed run (the GPU check) still ends with figures.
    """
    streams = build_streams(harness, suite, seed)
    all_batches = [b for cap in suite.caps for b in streams[cap]]
    for name in list(harness.modules):
        if name in harness.compile_seconds:
            continue
        if name != "eager" and deadline is not None and time.monotonic() > deadline:
            log.warning("throughput: time budget reached; path %s is not compiled or measured", name)
            harness.failed[name] = "skipped: the time budget (--budget-s) ran out before its compile"
            harness.modules.pop(name)
            continue
        harness.warm_up(name, all_batches)
    names = list(harness.modules)
    served = {cap: _served(harness, streams[cap]) for cap in suite.caps}
    runs: dict[int, dict[str, list[float]]] = {cap: {n: [] for n in names} for cap in suite.caps}
    samples = {cap: {n: [[] for _ in streams[cap]] for n in names} for cap in suite.caps}
    result: dict[str, Any] = {}
    for r in range(suite.repeats):
        if r and deadline is not None and time.monotonic() > deadline:
            log.warning("throughput: time budget reached after %d of %d repeats", r, suite.repeats)
            break
        for cap in suite.caps:
            batches = streams[cap]
            seconds = dict.fromkeys(names, 0.0)
            for j, batch in enumerate(batches):
                k = (r + j) % len(names)
                for name in names[k:] + names[:k]:
                    t = harness.time_forward(name, batch)
                    seconds[name] += t
                    samples[cap][name][j].append(t)
            tokens = sum(b.num_tokens for b in batches)
            for name in names:
                runs[cap][name].append(tokens / seconds[name])
        result = _result(harness, suite, streams, runs, samples, served, seed)
        if on_repeat is not None:
            on_repeat(result)
    return result


def _served(harness: StageHarness, batches: Sequence[Batch]) -> dict[str, str]:
    """Per graphed path, ``"6/6"``: forwards served by a captured graph. pp_breakable: counted (padded to a
    bucket; ``+Nc``: Dynamo recompiled); torch's reduce-overhead: forwards whose exact size is a bucket."""
    served = {}
    buckets = set(harness.buckets)
    for name in harness.modules:
        kind = harness.paths[name].kind
        if kind == "reduce-overhead":
            served[name] = f"{sum(b.num_tokens in buckets for b in batches)}/{len(batches)}"
        if kind != "pp_breakable":
            continue
        before = counters.snapshot()
        harness.time_stream(name, batches)
        after = counters.snapshot()
        compiles = after["backend_compiles"] - before["backend_compiles"]
        served[name] = f"{after['replays'] - before['replays']}/{len(batches)}" + (
            f" +{compiles}c" if compiles else "")
    return served


def _result(
    harness: StageHarness,
    suite: Suite,
    streams: dict[int, list[Batch]],
    runs: dict[int, dict[str, list[float]]],
    samples: dict[int, dict[str, list[list[float]]]],
    served: dict[int, dict[str, str]],
    seed: int,
) -> dict[str, Any]:
    rows = []
    for cap in suite.caps:
        batches = streams[cap]
        tokens = sum(b.num_tokens for b in batches)
        tok_s = {n: tokens / sum(median(t) for t in per_fwd) for n, per_fwd in samples[cap].items()}
        rows.append({
            "cap": cap,
            "seed_cap": cap * suite.scale,
            "forwards": len(batches),
            "tokens": [b.num_tokens for b in batches],
            "mean_tokens": sum(b.num_tokens for b in batches) / len(batches),
            "mean_seqs": sum(len(b.seq_lens) for b in batches) / len(batches),
            "tok_s": tok_s,
            "ratio": {n: v / tok_s["eager"] for n, v in tok_s.items()},
            "runs": runs[cap],
            "served": served[cap],
        })
    return {
        "kind": "throughput",
        "machine": machine_info(harness.device),
        "stage": harness.spec.describe(),
        "suite": {"scale": suite.scale, "forwards": suite.forwards,
                  "repeats": min(len(v) for v in runs[suite.caps[0]].values()),
                  "capture_cap": suite.capture_cap, "isl": suite.isl, "seed": seed},
        "paths": [{"name": n, "label": harness.paths[n].label, "graph_mode": harness.graph_mode(n),
                   "compile_s": harness.compile_seconds.get(n), "max_diff": harness.max_diffs.get(n),
                   "capture": harness.captures.get(n)}
                  for n in harness.modules],
        "failed": dict(harness.failed),
        "rows": rows,
    }


def _captured(capture: dict[str, Any] | None) -> str:
    """The capture part of a path's legend line: graphs, buckets, seconds and (CUDA) pool growth."""
    if not capture or not capture.get("graphs"):
        return ""
    pool = capture.get("measured_bytes")
    memory = f", pool {pool / 2**20:.0f} MiB" if pool is not None else ""
    return (f", of which capture {capture['seconds']:.1f} s ({capture['graphs']} graphs, "
            f"{capture['buckets']} buckets{memory})")


def _si(x: float) -> str:
    return f"{x / 1e3:,.1f}K" if x < 1e6 else f"{x / 1e6:,.2f}M"


def _cap_name(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def markdown(result: dict[str, Any]) -> str:
    """The seed-style table (tok/s per cap, ratio against eager) and how each path was served."""
    paths = result["paths"]
    names = [p["name"] for p in paths]
    s = result["suite"]
    headers = ["cap (seed cap)", "tokens/fwd", "seqs/fwd"] + [f"{n} tok/s" for n in names]
    rows = []
    for row in result["rows"]:
        cells = [f"{row['cap']} ({_cap_name(row['seed_cap'])})", f"{row['mean_tokens']:.0f}",
                 f"{row['mean_seqs']:.1f}"]
        for n in names:
            cell = _si(row["tok_s"][n])
            if n != "eager":
                cell += f" ({row['ratio'][n]:.2f}x)"
            cells.append(cell)
        rows.append(cells)
    legend = "\n".join(
        f"- `{p['name']}`: {p['label']}; graphs: {p['graph_mode']}"
        + (f"; first call (compile + capture) {p['compile_s']:.1f} s" if p.get("compile_s") else "")
        + _captured(p.get("capture"))
        + (f"; max abs diff vs eager {p['max_diff']:.1e}" if p.get("max_diff") is not None else "")
        for p in paths
    )
    failed = result.get("failed", {})
    legend += "".join(f"\n- `{n}`: {not_measured(why)}" for n, why in failed.items())
    served = [
        f"`{n}` " + ", ".join(row["served"][n] for row in result["rows"])
        for n in names if all(n in row["served"] for row in result["rows"])
    ]
    out = [
        f"Stage: {result['stage']}. Caps: the seed's 2K..32K / {s['scale']}; `pp_breakable` captures its "
        f"default ladder up to {s['capture_cap']} tokens (8192 / {s['scale']}) and runs larger forwards "
        f"eagerly. Stream per cap: {s['forwards']} forwards of requests with {s['isl'] // 2}..{s['isl']} "
        f"prompt tokens, chunked; {s['repeats']} runs, paths interleaved forward by forward; tok/s from "
        "each forward's median time.",
        "",
        markdown_table(headers, rows),
        "",
        legend,
    ]
    if served:
        out += ["", "Forwards served by a captured graph, per cap (`pp_breakable` pads to a bucket and runs "
                "the rest eagerly; `torch-ro` graphs exact bucket sizes only and runs the rest without "
                "graphs; `+Nc`: Dynamo recompiled): " + "; ".join(served) + "."]
    spreads = [max(v) / min(v) for row in result["rows"] for v in row["runs"].values() if len(v) > 1]
    if spreads:
        out += ["", f"Noise: a cell's whole-stream runs differ by {median(spreads):.2f}x fastest/slowest "
                f"(median over cells; worst {max(spreads):.2f}x)."]
    if result["machine"]["device"] == "cuda":
        out += ["", _target_line(result)]
    out += ["", f"Machine: {describe_machine(result['machine'])}."]
    return "\n".join(out)


TARGET_RATIO_AT_2K = 2.5


def _target_line(result: dict[str, Any]) -> str:
    """The issue's GPU target: at the 2K cap, graphs at least 2.5x eager tok/s."""
    row = next((r for r in result["rows"] if r["seed_cap"] == 2048), result["rows"][0])
    ppb = {n: v for n, v in row["ratio"].items() if n.startswith("ppb")}
    if not ppb:
        return "Target (2K cap, graphs >= 2.5x eager): no pp_breakable path was measured."
    best = max(ppb, key=lambda n: ppb[n])
    verdict = "met" if ppb[best] >= TARGET_RATIO_AT_2K else "NOT met"
    return (f"Target at the {_cap_name(row['seed_cap'])} cap, graphs >= {TARGET_RATIO_AT_2K}x eager: "
            f"{verdict} (best `{best}` {ppb[best]:.2f}x).")


def plot(result: dict[str, Any], path: Path) -> bool:
    """tok/s against cap per path, and the ratio against eager; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = result["rows"]
    caps = [r["cap"] for r in rows]
    names = [p["name"] for p in result["paths"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for n in names:
        ax1.plot(caps, [r["tok_s"][n] for r in rows], marker="o", label=n)
        ax2.plot(caps, [r["ratio"][n] for r in rows], marker="o", label=n)
    capture_cap = result["suite"]["capture_cap"]
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(caps, [f"{c}\n({_cap_name(r['seed_cap'])})" for c, r in zip(caps, rows)])
        ax.axvline(capture_cap, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("aggregate cap, tokens (seed cap)")
        ax.grid(True, alpha=0.3)
    ax1.set_ylabel("tokens/s")
    ax1.set_title("prefill throughput")
    ax2.set_ylabel("x eager")
    ax2.set_title("against eager (dotted: capture cap)")
    ax2.axhline(1.0, color="black", linewidth=0.8)
    ax1.legend(fontsize=8)
    m = result["machine"]
    fig.suptitle(f"{result['stage']}\n{m.get('gpu') or m['processor']}, torch {m['torch']}, {m['date']}",
                 fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_suite_arguments(parser)
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="where JSON and PNG go")
    args = parser.parse_args(argv)
    suite = suite_from_args(args)
    apply_threads(suite)
    harness = make_harness(suite)
    out: Path = args.out
    result = run_throughput(harness, suite, seed=args.seed,
                            on_repeat=lambda res: save_json(out / "throughput.json", res))
    print(markdown(result))
    if harness.device.type == "cpu":
        print("\nnote: " + CPU_NOTE)
    if plot(result, out / "prefill_throughput.png"):
        print(f"plot: {out / 'prefill_throughput.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

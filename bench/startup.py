"""Startup of a deep stage: the first call of a fresh process, cold and warm, flat and traced once.

A middle PP stage of the reference decoder (hidden 64, its own code unchanged) with 4, 32 and 80 layers,
eager and Inductor segments, each flat (Dynamo traces every layer) and with
``ppcompile.trace_layers_once`` (stamped layers, its default, and regions with ``stamp=False``). Every
row is a fresh Python process that compiles the stage and makes its first call at 16 tokens: Dynamo's
trace, ppcompile's passes, the segment compiles, the capture and one forward. The breakdown comes from
the stage's compile record and capture records.

Capture is ``capture="lazy"`` by default (``--capture all`` for the whole ladder): the first call
captures its own bucket. The issue bounds capture with lazy and budgeted capture, and on CPU a
whole-ladder capture is mostly the emulation running every segment once at 8192 tokens, compute that
grows with the layers in cold and restarted processes alike; ``bench/compile_time.py`` reports it.

- **cold**: Inductor's on-disk caches (FX graph, AOTAutograd) off. The Inductor cache directory is shared
  and warmed once first, so its one-time CPU-ISA probe (paid once per machine) is not in the rows.
- **warm**: the caches on, in a cache directory of the row's own that one process of the same stage
  filled just before: what a restart of the same stage costs.

- **store / restart**: ``ppcompile.warm_compile`` in a cache directory of the row's own (ppcompile's
  and Inductor's): the first process traces and stores the stage, each later one (best of
  ``--repeats``) reads it back and skips Dynamo's trace, the passes and the segment compiles.

Prints the table and the issue's targets (cold, 32 vs 4 layers: at most 1.5x with eager segments and
1.3x with Inductor's, traced once; a restart at most 0.25x cold). Run: ``python bench/startup.py [--write]``
(``--write`` updates the "Startup" section of docs/benchmarks.md); ``--quick`` is a smoke run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.compile_time import NO_DISK_CACHES, ONCE, ONCE_REGIONS, WARM_START, run_child
from bench.report import describe_machine, machine_info, markdown_table, save_json, update_markdown_section

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "bench" / "results" / "cpu" / "startup.json"
COMPILERS = ("eager", "eager" + ONCE, "eager" + ONCE_REGIONS, "inductor", "inductor" + ONCE,
             "inductor" + ONCE_REGIONS)
RESTARTS = ("eager", "inductor")  # ppcompile.warm_compile: flat traces (aot_compile refuses a patched layer)
# cold, most layers vs fewest
TARGETS = {"eager" + ONCE: 1.5, "inductor" + ONCE: 1.3}
WARM_TARGET = 0.25  # warm first call / cold first call
MOE_EXPERTS = 4  # the MoE rows: the same stage with MoE layers of this many experts, cold only
MOE_COMPILERS = ("eager", "eager" + ONCE, "eager" + ONCE_REGIONS)


def _child(layers: int, compiler: str, env: dict[str, str], max_tokens: int | None,
           capture: str, experts: int = 0) -> dict[str, Any]:
    extra = ["--max-tokens", str(max_tokens)] if max_tokens is not None else []
    row = run_child(["--child", str(layers), compiler, "--capture", capture, "--experts", str(experts),
                     *extra], env)
    return {**row, "experts": experts}


def _cold_rows(layers: Sequence[int], repeats: int, env: dict[str, str], max_tokens: int | None,
               capture: str) -> dict[tuple[int, str, int], dict[str, Any]]:
    """The fastest of ``repeats`` cold processes per (layers, compiler, experts), taken in rounds over
    all of them: the machine's speed drifts over a run, and a round reaches the rows a target compares
    (32 vs 4 layers) alike, where one row's repeats after another's would not."""
    best: dict[tuple[int, str, int], dict[str, Any]] = {}
    kinds = [(n, c, 0) for n in layers for c in COMPILERS] + [(n, c, MOE_EXPERTS) for n in layers
                                                            for c in MOE_COMPILERS]
    for _ in range(repeats):
        for n, compiler, experts in kinds:
            row = _child(n, compiler, env, max_tokens, capture, experts)
            if (n, compiler, experts) not in best or row["total"] < best[(n, compiler, experts)]["total"]:
                best[(n, compiler, experts)] = row
    return best


def measure(layers: Sequence[int], repeats: int, max_tokens: int | None,
            capture: str) -> list[dict[str, Any]]:
    """Cold and restart rows (best of ``repeats`` processes) and warm rows (the second of two processes
    sharing a fresh cache dir) for every (layers, compiler)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="ppcompile_bench_startup_") as root:
        base = {**os.environ, "PYTHONWARNINGS": "ignore"}
        cold_env = {**base, "TORCHINDUCTOR_CACHE_DIR": f"{root}/cold", **NO_DISK_CACHES}
        _child(layers[0], "inductor", cold_env, max_tokens, capture)  # the one-time ISA probe and headers
        colds = _cold_rows(layers, repeats, cold_env, max_tokens, capture)
        for n in layers:
            for compiler in COMPILERS:
                cold = colds[(n, compiler, 0)]
                warm_env = {**base, "TORCHINDUCTOR_CACHE_DIR": f"{root}/warm-{n}-{compiler.replace(' ', '')}"}
                _child(n, compiler, warm_env, max_tokens, capture)  # fills the cache dir
                warm = _child(n, compiler, warm_env, max_tokens, capture)
                rows += [{**cold, "start": "cold"}, {**warm, "start": "warm"}]
                print(f"{n:3d} layers {compiler:16s} cold {cold['total']:6.2f} s  "
                      f"warm {warm['total']:6.2f} s", file=sys.stderr)
            for compiler in RESTARTS:
                tag = f"{n}-{compiler}"
                env = {**base, "TORCHINDUCTOR_CACHE_DIR": f"{root}/restart-{tag}",
                       "PPCOMPILE_CACHE_DIR": f"{root}/ppcompile-{tag}"}
                store = _child(n, compiler + WARM_START, env, max_tokens, capture)  # stores the artifact
                restart = min((_child(n, compiler + WARM_START, env, max_tokens, capture)
                               for _ in range(repeats)), key=lambda r: r["total"])
                rows += [{**store, "start": "store"}, {**restart, "start": "restart"}]
                print(f"{n:3d} layers {compiler + WARM_START:16s} store {store['total']:6.2f} s  "
                      f"restart {restart['total']:6.2f} s", file=sys.stderr)
            for compiler in MOE_COMPILERS:
                cold = colds[(n, compiler, MOE_EXPERTS)]
                rows.append({**cold, "start": "cold"})
                print(f"{n:3d} layers {compiler:16s} MoE cold {cold['total']:6.2f} s", file=sys.stderr)
    return rows


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} s"


def render(results: dict[str, Any]) -> str:
    rows = [r for r in results["rows"] if not r.get("experts")]
    moe = [r for r in results["rows"] if r.get("experts")]
    ladder = "default capture ladder (74 buckets up to 8192)" if results["max_tokens"] is None else \
        f"capture ladder up to {results['max_tokens']}"
    capture = results.get("capture", "all")
    policy = ("`capture=\"lazy\"` (the first call captures its own bucket; the whole ladder's capture is in "
              "\"Compile time\" above)" if capture == "lazy" else
              "`capture=\"all\"` (the first call captures the whole ladder: on CPU the emulation runs every "
              "graph segment once at the largest bucket)")
    out = ["## Startup", "", f"`python bench/startup.py --write` on {describe_machine(results['info'])}.", "",
           f"Middle stage of the reference decoder, hidden 64, {ladder}, {policy}, first call at 16 "
           "tokens, one "
           "fresh process per row. `+ once`: `ppcompile.trace_layers_once(stage)` before `torch.compile` "
           "(the model's code unchanged; Dynamo traces the first layer, each other one is one op, checked "
           "and expanded by the backend); `+ once (regions)`: `ppcompile.trace_layers_once(stage, "
           "stamp=False)` (alike modules big enough to pay become nested compile regions). "
           "Cold: Inductor's on-disk caches off (best of "
           f"{results['repeats']}, taken in rounds over all cold rows); warm: caches on, after one "
           "process of the same stage filled them. "
           "`+ warm start`: `ppcompile.warm_compile(stage, options)` instead of `torch.compile`, in a "
           "cache directory of its own (ppcompile's and Inductor's); store: its first process, which "
           "traces and stores; restart: a later process (best of "
           f"{results['repeats']}), which skips Dynamo's trace and reads back "
           "(read back) the stored lowered stage, Inductor's kernels included: no passes or segment "
           "compiles run; on CPU it takes the stored answer of Inductor's vector-ISA probe instead of "
           "probing. With Inductor segments a store row also "
           "pays Inductor's one-time CPU-ISA probe (its cache directory starts empty). Regions: calls "
           "through nested compile regions / distinct traces of them.", ""]
    main_keys = ("dynamo_trace", "read_back", "passes", "segment_compile", "capture", "total")
    table = [[r["layers"], r["compiler"], r["start"], f"{r['region_calls']} / {r['region_traces']}",
              r.get("stamped_layers", 0), *(_fmt(r.get(k)) for k in main_keys)] for r in rows]
    out.append(markdown_table(["layers", "segments", "start", "regions", "stamped", "dynamo trace",
                               "read back", "passes", "segment compile", "capture", "first call"], table))
    if moe:
        out += ["", f"The same stage with MoE layers ({moe[0]['experts']} experts each; with `+ once` each "
                "layer after the first is stamped; with `+ once (regions)` each layer's MoE block is a "
                "region), cold:", ""]
        moe_keys = ("dynamo_trace", "passes", "capture", "total")
        table = [[r["layers"], r["compiler"], f"{r['region_calls']} / {r['region_traces']}",
                  r.get("stamped_layers", 0), *(_fmt(r.get(k)) for k in moe_keys)] for r in moe]
        out.append(markdown_table(["layers", "segments", "regions", "stamped", "dynamo trace", "passes",
                                   "capture", "first call"], table))
    out += ["", "### Against the targets", ""]
    out += _targets(rows) + _moe_targets(moe) + _collections(rows + moe)
    return "\n".join(out) + "\n"


def _collections(rows: list[dict[str, Any]]) -> list[str]:
    """The rows whose first call ran a full garbage collection: a step in the figures that moves with
    the heap's size, not with what the row measures."""
    hit = [r for r in rows if r.get("full_collections")]
    if not hit:
        return []
    named = [f"{'MoE, ' if r.get('experts') else ''}{r['layers']} layers {r['compiler']} "
             f"{r.get('start', 'cold')}: {r['full_collections']} ({r['full_collection_seconds']:.2f} s)"
             for r in hit]
    return ["- full garbage collections in the first call (CPython's, of the whole heap): "
            + "; ".join(named) + "."]


def _moe_targets(rows: list[dict[str, Any]]) -> list[str]:
    """The cold ratios of the MoE stage, and what tracing once saves on it."""
    if not rows:
        return []
    by = {(r["layers"], r["compiler"]): r for r in rows}
    layers = sorted({r["layers"] for r in rows})
    lines = []
    for hi in layers[1:]:
        for compiler in MOE_COMPILERS:
            a, b = by[(layers[0], compiler)], by[(hi, compiler)]
            ratio = b["total"] / a["total"]
            target = TARGETS.get(compiler)
            verdict = "" if target is None else \
                f" (target <= {target}x: {'met' if ratio <= target else 'not met'})"
            lines.append(f"- cold, MoE stage, {compiler} segments, {hi} vs {layers[0]} layers: "
                         f"{ratio:.2f}x{verdict}.")
    for n in layers:
        flat = by[(n, MOE_COMPILERS[0])]
        for compiler in MOE_COMPILERS[1:]:
            other = by[(n, compiler)]
            lines.append(f"- MoE stage, {n} layers, {compiler} vs flat: Dynamo trace "
                         f"{other['dynamo_trace'] / flat['dynamo_trace']:.2f}x, first call "
                         f"{other['total'] / flat['total']:.2f}x.")
    return lines


def _targets(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    by = {(r["layers"], r["compiler"], r["start"]): r for r in rows}
    layers = sorted({r["layers"] for r in rows})
    lo = layers[0]
    for compiler in COMPILERS:
        for hi in layers[1:]:
            a, b = by[(lo, compiler, "cold")], by[(hi, compiler, "cold")]
            ratio = b["total"] / a["total"]
            target = TARGETS.get(compiler)
            verdict = "" if target is None else \
                f" (target <= {target}x: {'met' if ratio <= target else 'not met'})"
            lines.append(f"- cold, {compiler} segments, {hi} vs {lo} layers: {ratio:.2f}x{verdict}; Dynamo "
                         f"trace {b['dynamo_trace'] / a['dynamo_trace']:.2f}x, capture "
                         f"{b['capture'] / a['capture']:.2f}x.")
    for compiler in COMPILERS:
        hi = layers[-1]
        cold, warm = by[(hi, compiler, "cold")], by[(hi, compiler, "warm")]
        ratio = warm["total"] / cold["total"]
        lines.append(f"- warm vs cold, {compiler} segments, {hi} layers, torch's caches alone: {ratio:.2f}x.")
    for compiler in RESTARTS:
        for n in layers:
            cold, restart = by[(n, compiler, "cold")], by[(n, compiler + WARM_START, "restart")]
            ratio = restart["total"] / cold["total"]
            lines.append(f"- restart vs cold, {compiler} segments, {n} layers: {ratio:.2f}x "
                         f"(target <= {WARM_TARGET}x: {'met' if ratio <= WARM_TARGET else 'not met'}).")
        r = by[(layers[-1], compiler + WARM_START, "restart")]
        parts = {k: r.get(k) or 0.0 for k in ("read_back", "passes", "segment_compile", "capture")}
        lines.append(f"- where a restart spends its first call, {compiler} segments, {layers[-1]} layers: "
                     + ", ".join(f"{k.replace('_', ' ')} {v:.2f} s" for k, v in parts.items())
                     + f", the rest (loading Dynamo's guards and bytecode, the forward) "
                       f"{r['total'] - sum(parts.values()):.2f} s.")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 32, 80])
    parser.add_argument("--repeats", type=int, default=1, help="cold processes per row (the fastest)")
    parser.add_argument("--max-tokens", type=int, default=None, help="cap of the capture ladder")
    parser.add_argument("--capture", choices=("lazy", "all"), default="lazy",
                        help="the stages' capture policy (lazy: the first call captures its own bucket)")
    parser.add_argument("--quick", action="store_true", help="2 and 4 layers, cap 64: a smoke run")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.max_tokens, args.repeats = [2, 4], 64, 1
    results = {"info": machine_info("cpu", threads=1), "max_tokens": args.max_tokens, "repeats": args.repeats,
               "capture": args.capture,
               "rows": measure(args.layers, args.repeats, args.max_tokens, args.capture)}
    text = render(results)
    print(text)
    if not args.quick:
        save_json(RESULTS, results)
    if args.write:
        update_markdown_section(DOC, "startup", text)
        print(f"wrote {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()

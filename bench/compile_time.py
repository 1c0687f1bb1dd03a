"""Startup and steady state of the segment compilers.

1. **Compile + capture, cold process.** A middle PP stage of the reference decoder (hidden 64) with 4,
   16 and 32 layers, the default capture ladder (74 buckets up to 8192), for each segment compiler,
   and for Inductor segments also with the layers marked as nested compile regions (traced once).
   Each (layers, compiler) runs in fresh Python processes that compile the stage and make its first
   call (Dynamo trace, passes, segment compiles, capture of every bucket, one forward); the fastest
   of ``--repeats`` processes is reported. Inductor's on-disk FX-graph and AOT caches are off, so every
   process compiles for real; the Inductor cache directory is shared and warmed once first, so its
   one-time CPU-ISA probe and header builds (paid once per machine) are reported apart.
2. **Steady state, one run.** A 32-layer stage of width 64 (the reference) and of width 16 (every op
   costs about its dispatch), per-forward latency at 16, 64 and 256 tokens for: eager;
   ``pp_breakable`` with eager segments; ``pp_breakable`` with Inductor segments under
   ``graph_mode="emulate"`` (the graph path on CPU: a replay re-runs the segment and copies into the
   captured outputs, copies a GPU graph does not make), ``"eager"`` (the same static buffers, no
   emulation) and ``"none"`` (the compiled segments at the live size, no buffers: what ``"auto"``
   picks on CPU; also with Inductor's ``cpp_wrapper``); whole-graph Inductor
   (``torch.compile(stage, backend="inductor")``, no breaks: the bound breaks can approach; also with
   ``cpp_wrapper``), the live-size and whole-graph paths once more with Dynamo's guards on modules
   skipped (``guard_filter_fn=torch.compiler.skip_guard_on_all_nn_modules_unsafe``: what every
   compiled path pays for its guards). Compiled paths get their symbolic token count from
   ``ppcompile.mark_token_dynamic``; two more rows compile with ``dynamic=True`` to show its per-call
   cost. Paths are timed interleaved, and the best of many rounds is reported: on a shared machine
   the least-disturbed round is the estimate other jobs perturb least.

Run: ``python bench/compile_time.py [--write]`` (``--write`` updates the "Compile time" section of
docs/benchmarks.md). ``--quick`` shrinks everything for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import ppcompile
from bench.report import (
    describe_machine,
    full_collections,
    machine_info,
    markdown_table,
    update_markdown_section,
)
from ppcompile.models import ModelConfig, make_batch, make_forward_context, make_stage, set_forward_context
from ppcompile.pipeline.inprocess import STAGE_RECOMPILE_LIMIT
from ppcompile.torch_internals import raise_recompile_limit

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "bench" / "results" / "cpu" / "compile_time.json"
CFG = ModelConfig()  # hidden 64, MLP 128, 4/2 heads x 16: narrow, so small forwards are overhead-bound
PP = 3  # a middle stage: proxies in and out
REGIONS = " + regions"  # the stage's layers marked as nested compile regions by hand (traced once)
ONCE = " + once"  # ppcompile.trace_layers_once(stage) on the unchanged stage: layers stamped from the first
ONCE_REGIONS = " + once (regions)"  # trace_layers_once(stage, stamp=False): alike modules as nested regions
WARM_START = " + warm start"  # ppcompile.warm_compile instead of torch.compile (its cache dir: the env's)
COMPILERS = ("eager", "inductor", "inductor" + REGIONS)
NO_DEDUP = " (no dedup)"  # the Inductor row with sharing off: what compiling every segment costs
NO_DISK_CACHES = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}


WHOLE = "whole-graph inductor"
# Dynamo's guards on every parameter and module attribute cost ~0.1-0.3 ms per forward of a 32-layer
# stage, paid by every compiled path alike; rows with this filter show what is left without them.
SKIP_MODULE_GUARDS = torch.compiler.skip_guard_on_all_nn_modules_unsafe
# (name, backend, options, dynamic): compiled paths get their symbolic token count from marked token
# dims (ppcompile.mark_token_dynamic) unless dynamic=True, whose rows show what that costs.
STEADY_PATHS: tuple[tuple[str, str | None, dict[str, Any] | None, bool | None], ...] = (
    ("eager", None, None, None),
    ("ppb eager segs (emulate)", "pp_breakable",
     {"segment_compiler": "eager", "graph_mode": "emulate"}, None),
    ("ppb inductor segs (emulate)", "pp_breakable",
     {"segment_compiler": "inductor", "graph_mode": "emulate"}, None),
    ("ppb inductor segs (static buffers)", "pp_breakable",
     {"segment_compiler": "inductor", "graph_mode": "eager"}, None),
    ("ppb inductor segs (live size)", "pp_breakable",
     {"segment_compiler": "inductor", "graph_mode": "none"}, None),
    (WHOLE, "inductor", None, None),
    ("ppb inductor segs (live size, cpp_wrapper)", "pp_breakable",
     {"segment_compiler": "inductor", "graph_mode": "none", "inductor_config": {"cpp_wrapper": True}}, None),
    (f"{WHOLE}, cpp_wrapper", "inductor", {"cpp_wrapper": True}, None),
    ("ppb inductor segs (live size), module guards skipped", "pp_breakable",
     {"segment_compiler": "inductor", "graph_mode": "none", "guard_filter_fn": SKIP_MODULE_GUARDS}, None),
    (f"{WHOLE}, module guards skipped", "inductor", {"guard_filter_fn": SKIP_MODULE_GUARDS}, None),
    ("ppb inductor segs (emulate), dynamic=True", "pp_breakable",
     {"segment_compiler": "inductor", "graph_mode": "emulate"}, True),
    (f"{WHOLE}, dynamic=True", "inductor", None, True),
)
TARGET_MODES = ("emulate", "static buffers", "live size")

NARROW = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1,
                     head_dim=8)  # width 16: every op costs about its dispatch only


def stage_config(layers: int, hidden: int = 64) -> ModelConfig:
    base = NARROW if hidden == 16 else CFG
    if base.hidden_size != hidden:
        raise SystemExit(f"--steady-hidden: 64 or 16, got {hidden}")
    return base.replace(num_layers=PP * layers)


# ------------------------------------------------------------------------------------------ part 1
def child_compile(layers: int, compiler: str, max_tokens: int | None, capture: str = "all",
                  experts: int = 0) -> dict[str, Any]:
    """In a fresh process: compile a ``layers``-layer stage, first call at 16 tokens; the breakdown.
    ``capture``: the stage's capture policy (``"all"``: the first call captures the whole ladder);
    ``experts``: MoE layers of that many experts (0: dense)."""
    from ppcompile.debug.capture import capture_records

    torch.set_num_threads(1)
    cfg = stage_config(layers).replace(compile_regions=compiler.endswith(REGIONS), num_experts=experts)
    stage = make_stage(cfg, 1, PP)
    if compiler.endswith(ONCE):
        ppcompile.trace_layers_once(stage)
    if compiler.endswith(ONCE_REGIONS):
        ppcompile.trace_layers_once(stage, stamp=False)
    # Capture is the graph path's: its CPU emulation here ("auto" would serve at the live size, no capture).
    warm_start = compiler.endswith(WARM_START)
    segment_compiler = compiler.removesuffix(WARM_START).removesuffix(NO_DEDUP).removesuffix(REGIONS) \
        .removesuffix(ONCE).removesuffix(ONCE_REGIONS)
    options: dict[str, Any] = {"segment_compiler": segment_compiler, "graph_mode": "emulate",
                               "capture": capture}
    if compiler.endswith(NO_DEDUP):
        options["dedup_segments"] = False
    if max_tokens is not None:
        options["max_capture_tokens"] = max_tokens
    n = 16
    _, pos, proxies = make_batch(cfg, [n], 1, PP)
    ctx = make_forward_context([n], cfg, range(stage.start_layer, stage.end_layer))
    with full_collections() as collections:
        start = time.perf_counter()
        if warm_start:
            compiled: Any = ppcompile.warm_compile(stage, options)
        else:
            compiled = torch.compile(stage, backend="pp_breakable", options=options)
        ppcompile.mark_token_dynamic(pos, proxies)
        with torch.inference_mode(), set_forward_context(ctx):
            compiled(None, pos, pp_proxy_tensors=proxies)
        total = time.perf_counter() - start
    (runtime,) = [rt for rt in ppcompile.stage_runtimes() if rt.eager_reason is None]
    warm: dict[str, Any] = {"read_back": compiled.load_seconds(), "artifacts_loaded": compiled.loaded,
                            "fallback": compiled.fallback_reason} if warm_start else {}
    times = dict(runtime.compiled.record.compile_times)
    records = runtime.compiled.record.segment_compiles
    captures = capture_records(runtime)
    return {
        "layers": layers, "compiler": compiler, "total": total,
        "dynamo_trace": times.get("dynamo_trace"), "passes": times.get("passes"),
        "segment_compile": times.get("segment_compile"),
        "capture": sum(c.seconds for c in captures),
        "capture_buckets": sum(len(c.buckets) for c in captures),
        "region_calls": sum(runtime.compiled.record.region_traces.values()),
        "region_traces": len(runtime.compiled.record.region_traces),
        "stamped_layers": runtime.compiled.record.stamped_layers,
        "graph_segments": sum(st.segment.is_graph for st in runtime.program.steps),
        "buckets": len(runtime.plan.sizes),
        "unique_compiles": sum(not r.reused for r in records), **warm,
        "full_collections": len(collections), "full_collection_seconds": sum(collections),
    }


def run_child(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"child {' '.join(args)} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compile_table(
    layer_counts: Sequence[int], max_tokens: int | None, cache: str, repeats: int
) -> tuple[list[dict[str, Any]], float]:
    """Every (layers, compiler) in its own cold process; plus the one-time Inductor setup cost."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, **NO_DISK_CACHES, "PYTHONWARNINGS": "ignore"}
    extra = ["--max-tokens", str(max_tokens)] if max_tokens is not None else []
    # Warm the shared cache dir: the first Inductor compile on a machine probes the CPU's vector ISA.
    probe = run_child(["--child", str(layer_counts[0]), "inductor", *extra], env)
    rows = []
    for L in layer_counts:
        for c in COMPILERS:
            runs = [run_child(["--child", str(L), c, *extra], env) for _ in range(repeats)]
            rows.append(min(runs, key=lambda r: r["total"]))
    rows.append(run_child(["--child", str(max(layer_counts)), "inductor" + NO_DEDUP, *extra], env))
    setup = probe["total"] - next(r["total"] for r in rows if r["layers"] == layer_counts[0]
                                  and r["compiler"] == "inductor")
    return rows, setup


# ------------------------------------------------------------------------------------------ part 2
def steady_state(
    layers: int, hidden: int, token_counts: Sequence[int], rounds: int, calls: int
) -> dict[str, Any]:
    """Median per-forward seconds by (path, token count), all paths timed interleaved in this process."""
    raise_recompile_limit(STAGE_RECOMPILE_LIMIT)  # six compiled instances share the forward code object
    torch.set_num_threads(1)
    cfg = stage_config(layers, hidden)
    sizes = sorted(token_counts)
    paths: dict[str, Callable[..., Any]] = {}
    for name, backend, options, dynamic in STEADY_PATHS:
        stage = make_stage(cfg, 1, PP)  # one instance per path: same weights, own Dynamo cache entries
        if backend is None:
            paths[name] = stage
        elif backend == "pp_breakable":
            ppb_options: dict[str, Any] = {**(options or {}), "capture_sizes": sizes}
            paths[name] = torch.compile(stage, backend=backend, dynamic=dynamic, options=ppb_options)
        else:
            paths[name] = torch.compile(stage, backend=backend, dynamic=dynamic, options=options)
    layer_ids = range(stage.start_layer, stage.end_layer)
    inputs = {}
    for n in sizes:
        _, pos, proxies = make_batch(cfg, [n], 1, PP, seed=n)
        ppcompile.mark_token_dynamic(pos, proxies)  # read by the paths compiled without dynamic=True
        inputs[n] = (pos, proxies, make_forward_context([n], cfg, layer_ids))
    warm = {}
    with torch.inference_mode():
        for name, fn in paths.items():  # compile + capture + warm up, and check against eager
            start = time.perf_counter()
            for n in sizes:
                pos, proxies, ctx = inputs[n]
                with set_forward_context(ctx):
                    got = fn(None, pos, pp_proxy_tensors=proxies)
                    want = paths["eager"](None, pos, pp_proxy_tensors=proxies)
                err = max(float((got[k] - want[k]).abs().max()) for k in want)
                if err > 1e-4:
                    raise SystemExit(f"{name} differs from eager at {n} tokens by {err}")
            warm[name] = time.perf_counter() - start
        samples: dict[tuple[str, int], list[float]] = {(p, n): [] for p in paths for n in sizes}
        for _ in range(rounds):
            for n in sizes:
                pos, proxies, ctx = inputs[n]
                with set_forward_context(ctx):
                    for name, fn in paths.items():
                        start = time.perf_counter()
                        for _ in range(calls):
                            fn(None, pos, pp_proxy_tensors=proxies)
                        samples[(name, n)].append((time.perf_counter() - start) / calls)
    return {"best": {f"{p}@{n}": min(v) for (p, n), v in samples.items()}, "warm_up": warm,
            "paths": list(paths), "sizes": sizes, "layers": layers, "hidden": hidden,
            "rounds": rounds}


# ------------------------------------------------------------------------------------------ report
def fmt(x: float | None, unit: str = "s") -> str:
    return "n/a" if x is None else f"{x:.2f} {unit}".rstrip()


def compile_markdown(rows: list[dict[str, Any]], setup: float, max_tokens: int | None) -> str:
    ladder = "default capture ladder (74 buckets up to 8192)" if max_tokens is None else \
        f"default ladder up to {max_tokens}"
    out = [f"### Cold-process compile + capture (middle stage, hidden 64, {ladder}, first call at 16 tokens)",
           "",
           "Each row is the fastest of fresh processes; Inductor's on-disk compile caches are off. "
           "Capture on CPU is the emulation: each graph segment runs once, at the largest bucket, and the "
           "smaller buckets capture views of its outputs, so it grows with layers, not with buckets. "
           "Compiled with `ppcompile.mark_token_dynamic` on the first call's inputs. "
           f"The `inductor{REGIONS}` rows mark the attention-free halves of each layer as "
           "`torch.compiler.nested_compile_region`s (`ModelConfig(compile_regions=True)`): Dynamo traces "
           f"them once per stage. The `inductor{NO_DEDUP}` row (one process) compiles every graph segment "
           "on its own (`dedup_segments=False`): what sharing saves.", ""]
    table = []
    for r in rows:
        table.append([r["layers"], r["compiler"], r["graph_segments"], r["unique_compiles"],
                      fmt(r["dynamo_trace"]), fmt(r["passes"]), fmt(r["segment_compile"]),
                      fmt(r["capture"]), fmt(r["total"])])
    headers = ["layers", "segment compiler", "graph segments", "compiled", "dynamo trace", "passes",
               "segment compile", "capture", "total first call"]
    out.append(markdown_table(headers, table))
    out += ["", f"One-time Inductor setup on a cold cache directory (CPU vector-ISA probe, headers), paid "
                f"once per machine and cache dir: {setup:.1f} s (not in the rows above).", ""]
    for c in COMPILERS:
        by_layers = {r["layers"]: r for r in rows if r["compiler"] == c}
        lo, hi = min(by_layers), max(by_layers)
        a, b = by_layers[lo], by_layers[hi]
        a_nc, b_nc = a["total"] - a["capture"], b["total"] - b["capture"]
        out.append(f"- {c} segments, {hi} vs {lo} layers: total {b['total'] / a['total']:.2f}x; without "
                   f"capture {b_nc:.2f} s vs {a_nc:.2f} s = {b_nc / a_nc:.2f}x; segment compile "
                   f"{b['segment_compile']:.2f} s vs {a['segment_compile']:.2f} s.")
    return "\n".join(out) + "\n"


def steady_markdown(steady: dict[str, Any]) -> str:
    sizes = steady["sizes"]
    med = steady["best"]
    out = [f"### Steady state ({steady['layers']}-layer stage, hidden {steady['hidden']}, per forward, "
           f"best of {steady['rounds']} interleaved rounds)",
           "", "Each cell: time per forward (eager time / path time, higher is faster; path time / "
           "whole-graph Inductor time, lower is faster).", ""]
    table = []
    for p in steady["paths"]:
        cells: list[Any] = [p]
        for n in sizes:
            t = med[f"{p}@{n}"]
            cells.append(f"{1e3 * t:.2f} ms ({med[f'eager@{n}'] / t:.2f}x, "
                         f"{t / med[f'{WHOLE}@{n}']:.2f})")
        table.append(cells)
    out.append(markdown_table(["path", *[f"{n} tokens" for n in sizes]], table))
    return "\n".join(out) + "\n"


def targets_markdown(results: dict[str, Any]) -> str:
    """The issue's targets against the figures of this run."""
    out = ["### Against the targets", ""]
    rows = results.get("compile", {}).get("rows", [])
    for compiler in ("inductor", "inductor" + REGIONS):
        ind = {r["layers"]: r for r in rows if r["compiler"] == compiler}
        if not ind:
            continue
        lo, hi = min(ind), max(ind)
        ratio = ind[hi]["total"] / ind[lo]["total"]
        grow = {k: ind[hi][k] - ind[lo][k] for k in ("dynamo_trace", "capture", "segment_compile")
                if ind[hi][k] is not None and ind[lo][k] is not None}
        out.append(f"- {hi}-layer stage at most 1.5x a {lo}-layer one (`{compiler}`, compile + "
                   f"capture): {ratio:.2f}x, {'met' if ratio <= 1.5 else 'not met'}. Segment compile "
                   f"{ind[lo]['segment_compile']:.2f} s -> {ind[hi]['segment_compile']:.2f} s "
                   f"({ind[lo]['unique_compiles']} -> {ind[hi]['unique_compiles']} unique compiles for "
                   f"{ind[lo]['graph_segments']} -> {ind[hi]['graph_segments']} graph segments): compile "
                   "work follows distinct segments, not layers. What grows with layers: "
                   + ", ".join(f"{k.replace('_', ' ')} +{v:.2f} s" for k, v in grow.items()
                               if k != "segment_compile") + ".")
    for steady in results.get("steady", []):
        best = steady["best"]
        n = min(steady["sizes"])
        eager, whole = best[f"eager@{n}"], best[f"{WHOLE}@{n}"]
        for mode in TARGET_MODES:
            t = best[f"ppb inductor segs ({mode})@{n}"]
            out.append(f"- hidden {steady['hidden']}, {n} tokens, Inductor segments ({mode}): "
                       f"{eager / t:.2f}x eager (target >= 2x: {'met' if eager / t >= 2 else 'not met'}), "
                       f"{t / whole:.2f}x whole-graph Inductor (target <= 1.25x: "
                       f"{'met' if t / whole <= 1.25 else 'not met'}); whole-graph Inductor itself is "
                       f"{eager / whole:.2f}x eager.")
    return "\n".join(out) + "\n"


def render(results: dict[str, Any]) -> str:
    parts = ["## Compile time", "", f"`python bench/compile_time.py --write` on "
             f"{describe_machine(results['info'])}.", ""]
    if "compile" in results:
        c = results["compile"]
        parts.append(compile_markdown(c["rows"], c["setup"], c["max_tokens"]))
    parts += [steady_markdown(s) for s in results.get("steady", [])]
    parts.append(targets_markdown(results))
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs=2, metavar=("LAYERS", "COMPILER"), help=argparse.SUPPRESS)
    parser.add_argument("--max-tokens", type=int, default=None, help="cap of the capture ladder")
    parser.add_argument("--capture", choices=("all", "lazy"), default="all", help=argparse.SUPPRESS)
    parser.add_argument("--experts", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=2, help="cold processes per compile row (best)")
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16, 32])
    parser.add_argument("--steady-layers", type=int, default=32)
    parser.add_argument("--steady-hidden", type=int, nargs="+", default=[64, 16],
                        help="widths of the steady-state stage: 64 (reference) and/or 16 (narrow)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--part", choices=("all", "compile", "steady"), default="all")
    parser.add_argument("--json", type=Path, default=RESULTS,
                        help="raw results (written; read by --render)")
    parser.add_argument("--render", action="store_true", help="re-render the --json results; no run")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child_compile(int(args.child[0]), args.child[1], args.max_tokens, args.capture,
                                       args.experts)))
        return
    if args.quick:
        args.layers, args.steady_layers, args.max_tokens = [2, 4], 4, 64
        args.tokens, args.rounds, args.calls, args.repeats = [16, 64], 2, 2, 1
    if args.write and args.part != "all":
        raise SystemExit("--write needs --part all (the section holds both tables)")
    if args.render:
        results = json.loads(args.json.read_text())
    else:
        results = run(args)
        if not args.quick:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=1) + "\n")
    text = render(results)
    print(text)
    if args.write:
        update_markdown_section(DOC, "compile-time", text)
        print(f"wrote {DOC.relative_to(ROOT)}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"info": machine_info("cpu", threads=1)}
    with tempfile.TemporaryDirectory(prefix="ppcompile_bench_inductor_") as cache:
        if args.part in ("all", "compile"):
            rows, setup = compile_table(args.layers, args.max_tokens, cache, args.repeats)
            results["compile"] = {"rows": rows, "setup": setup, "max_tokens": args.max_tokens}
        if args.part in ("all", "steady"):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
            results["steady"] = [steady_state(args.steady_layers, hidden, args.tokens, args.rounds,
                                              args.calls) for hidden in args.steady_hidden]
    return results

if __name__ == "__main__":
    main()

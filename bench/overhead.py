"""Host overhead of ppcompile's runtime, per forward and per segment, on a tiny deep stage where compute
is negligible, against eager's per-op dispatch.

The stage is the whole reference decoder (one PP rank) with 32 layers of width 16 and a handful of
tokens, so each op costs almost only its dispatch. Timed interleaved, medians of many calls:

* ``eager``: the module's forward; divided by the ATen ops it dispatches (counted with
  ``torch.profiler``: top-level ``aten::`` ops) gives eager's cost per op;
* ``dynamo_eager``: ``torch.compile(backend="eager")``, Dynamo's own cost on this stage;
* ``compiled``: the ``pp_breakable`` module (Dynamo's guards and frame wrapper included);
* ``runtime``: the ``StageRuntime`` called directly with the arguments Dynamo hands it;
* the runtime once more with each part timed: segment bodies (a graph replay, or a break's eager
  op), copy-in (live inputs and break outputs into static buffers), and the rest (input checks,
  bucket choice, the generated per-call code: live-size views, outputs, bookkeeping);
* ``no-op bodies``: the runtime with every segment body a no-op (:class:`NoOpBodies`: a graph replay
  returns at once, a break returns its first call's outputs), through the instrumentation hook, so
  the plain path is untouched: what is left is ppcompile's own host time (checks, bucket choice,
  copy-in, bridge copies, live-size views, outputs); per graph segment against
  :data:`TARGET_NOOP_US_PER_GRAPH_SEGMENT`, measured twice: interleaved with the variants above (each
  no-op call follows an 18 ms instrumented forward, so it starts with cold caches), and back to back
  (``hot``: calls in a row, as a host thread issuing forwards for micro-batches does; the figure of
  ppcompile's code itself; on this kind of machine a call after the host idled for 20 ms costs several
  times as much).

One more plain call is profiled (``torch.profiler``; CUDA activity too on a GPU) with each copy-in and
bridge copy marked, and the ops and CUDA runtime calls under each mark are listed with their host time:
where a copy-in's time goes (issue 51: 384 µs for two small inputs on the first GPU run). On a GPU the
host time of a graph launch through ``CUDAGraph.replay()`` and through ``cudaGraphLaunch`` is measured
too (``graph_launch.py``).

``--out-variant`` builds the stage with the out-variant attention (``ppcompile::attention_with_output``,
vLLM's form): the graph before each break allocates its output and the break writes it in place, so no
bridge copy follows it (one torch dispatch less per graph segment).

Host time only (until the call returns; a GPU is synchronised after, untimed). Python's garbage
collector is off while timing (as in ``timeit``). Runtime overhead = instrumented call - segment
bodies - the timers' own cost, within each call; per segment = overhead / number of segments. On CPU
a graph "replay" is the emulation (re-running the segment and copying into its captured outputs); it
counts as the segment's body, as ``CUDAGraph.replay()`` does on a GPU.

Run alone: ``python bench/overhead.py [--device cpu|cuda] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import ppcompile
from bench.common import median, sync
from bench.graph_launch import compare_launches
from bench.graph_launch import markdown_lines as launch_lines
from bench.report import describe_machine, machine_info, markdown_table, save_json
from ppcompile.backends.pp_breakable import stage_runtimes
from ppcompile.config import graph_path_mode
from ppcompile.models import ModelConfig, make_batch, make_forward_context, make_stage, set_forward_context
from ppcompile.runtime.stage_runtime import StageRuntime

__all__ = ["TINY_DEEP", "markdown", "run_overhead"]

TINY_DEEP = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=32, num_heads=2,
                        num_kv_heads=1, head_dim=8, max_position=64)
TARGET_US_PER_SEGMENT = 10.0
TARGET_NOOP_US_PER_GRAPH_SEGMENT = 2.0  # ppcompile's own host time, segment bodies no-ops
_TOKENS = 6  # live tokens per forward (bucket 8)
_BUCKETS = [4, 8, 16]


_PARTS = {"graph replays": "segment bodies", "break segments": "segment bodies", "bridge copies": "copy-in"}


class Stopwatch:
    """Exclusive time per category of nested wrapped calls."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self._children: list[float] = []

    def wrap(self, category: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._children.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                children = self._children.pop()
                self.seconds[category] += elapsed - children
                self.calls[category] += 1
                if self._children:
                    self._children[-1] += elapsed

        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


class NoOpBodies:
    """A ``wrap`` hook for ``StageRuntime.instrumented`` that makes segment bodies no-ops: a graph
    replay returns at once (its outputs keep their last values), a break segment returns the outputs
    of its first call under the hook (computed once). Copies, views and everything else run as on the
    plain path. Only for executors that bind inputs (a CUDA graph, the emulation): the graph path reads
    their outputs from the slot table, not from what a replay returns."""

    def __call__(self, category: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if category == "graph replays":
            return _noop
        if category == "break segments":
            return _first_result(fn)
        return fn


def _noop(*args: Any) -> None:
    return None


def _first_result(fn: Callable[..., Any]) -> Callable[..., Any]:
    results: list[Any] = []

    def cached(*args: Any) -> Any:
        if not results:
            results.append(fn(*args))
        return results[0]

    return cached


def timer_cost(calls: int = 20000) -> float:
    """Seconds a :class:`Stopwatch` wrapper adds to one call (a wrapped no-op against a bare one)."""
    def noop() -> None:
        return None

    wrapped = Stopwatch().wrap("noop", noop)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            wrapped()
        mid = time.perf_counter()
        for _ in range(calls):
            noop()
        best = min(best, ((mid - start) - (time.perf_counter() - mid)) / calls)
    return max(best, 0.0)


def count_aten_ops(fn: Callable[[], Any]) -> int:
    """ATen ops one call of ``fn`` dispatches from Python (top-level ``aten::`` profiler events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    count = 0
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        count += parent is None
    return count


def run_overhead(device: torch.device | str = "cpu", iters: int = 300, graph_mode: str | None = None,
                 layers: int | None = None, output_slots: int = 1,
                 out_variant: bool = False) -> dict[str, Any]:
    """Measures eager per-op cost and ppcompile's runtime overhead on :data:`TINY_DEEP` (``layers``
    overrides its depth); returns the JSON-able result. ``graph_mode`` defaults to the graph path
    (``graph_path_mode``: CUDA graphs on a GPU, the emulation on CPU); ``output_slots``: the option (a
    ring of output slots costs a copy per output per forward, timed as ``output copies``);
    ``out_variant``: the stage's attention writes into an output its caller allocates (no bridge copy)."""
    device = torch.device(device)
    graph_mode = graph_mode or graph_path_mode(device.type)
    cfg = TINY_DEEP.replace(attention_with_output=out_variant)
    cfg = cfg if layers is None else cfg.replace(num_layers=layers)
    torch._dynamo.reset()
    stage = make_stage(cfg, 0, 1, device)
    lens = [_TOKENS // 2, _TOKENS - _TOKENS // 2]
    ids, pos, _ = make_batch(cfg, lens, 0, 1, device=device)
    ctx = make_forward_context(lens, cfg, range(cfg.num_layers), device=device)
    options: dict[str, Any] = {"capture_sizes": _BUCKETS, "graph_mode": graph_mode,
                               "output_slots": output_slots}
    ppcompile.mark_token_dynamic(ids, pos)  # not dynamic=True: see the user guide
    compiled = torch.compile(stage, backend="pp_breakable", options=options)
    with torch.inference_mode(), set_forward_context(ctx):
        compiled(ids, pos)
        runtime = _runtime_of_last_compile()
        args = _args_dynamo_passes(runtime, lambda: compiled(ids, pos))
        dynamo_eager = torch.compile(stage, backend="eager")
        watch = Stopwatch()

        def wrap(category: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            """The runtime's parts, grouped: segment bodies (replays and breaks) and copies."""
            return watch.wrap(_PARTS.get(category, category), fn)
        # One object for the whole run: the runtime keeps the instrumented code it generates per hook.

        def run_instrumented() -> None:
            with runtime.instrumented(wrap):
                watch.reset()
                start = time.perf_counter()
                runtime(*args)
                per_call.append({**watch.seconds, "total": time.perf_counter() - start})
                wrapped_calls.append(sum(watch.calls.values()))
            sync(device)  # untimed: host time is what is measured

        noop_hook = NoOpBodies()  # one object: the runtime keeps the path it binds per hook
        binds = all(state.executor.binds_inputs for state in runtime.instances())

        def run_noop() -> None:
            if not binds:
                return
            with runtime.instrumented(noop_hook):
                start = time.perf_counter()
                runtime(*args)
                noop_times.append(time.perf_counter() - start)

        variants: dict[str, Callable[[], Any]] = {
            "eager": lambda: stage(ids, pos),
            "dynamo_eager": lambda: dynamo_eager(ids, pos),
            "compiled": lambda: compiled(ids, pos),
            "runtime": lambda: runtime(*args),
        }
        per_call: list[dict[str, float]] = []
        wrapped_calls: list[int] = []
        noop_times: list[float] = []
        for _ in range(max(3, iters // 10)):  # compile, warm caches and the allocator
            for fn in variants.values():
                fn()
            run_instrumented()
            run_noop()
        per_call.clear()
        wrapped_calls.clear()
        noop_times.clear()
        times: dict[str, list[float]] = {k: [] for k in variants}
        names = list(variants)
        gc.collect()
        gc.disable()  # as timeit does: a collection inside one call is noise here, not overhead
        try:
            for i in range(iters):  # interleaved, rotating order: a noisy neighbour hits every variant
                for name in names[i % len(names):] + names[: i % len(names)]:
                    start = time.perf_counter()
                    variants[name]()
                    times[name].append(time.perf_counter() - start)
                    sync(device)  # untimed: host time is what is measured
                run_instrumented()
                run_noop()
                runtime(*args)  # real values in every static buffer again after the no-op call
            hot_times: list[float] = []
            if binds:
                with runtime.instrumented(noop_hook):
                    for _ in range(iters):  # back to back: the no-op path with warm caches
                        start = time.perf_counter()
                        runtime(*args)
                        hot_times.append(time.perf_counter() - start)
                runtime(*args)
        finally:
            gc.enable()
        eager_us, dynamo_eager_us, compiled_us, runtime_us = (1e6 * median(times[k]) for k in names)
        ops = count_aten_ops(lambda: stage(ids, pos))
        part_profile = profile_parts(runtime, args, device)
    launches = compare_launches(device)
    segments = len(runtime.program.steps)
    graph_segments = sum(1 for s in runtime.program.steps if s.segment.is_graph)
    parts_us = {k: 1e6 * median([c.get(k, 0.0) for c in per_call]) for k in per_call[0]}
    instrumented_us = parts_us.pop("total")
    parts_us["rest (bucket, dispatch, bookkeeping)"] = 1e6 * median(
        [c["total"] - sum(v for k, v in c.items() if k != "total") for c in per_call])
    # Same-call figures (robust to a noisy neighbour): call minus segment bodies, minus the timers' cost.
    timer_us = 1e6 * timer_cost()
    noop_us = 1e6 * median(noop_times) if noop_times else None
    hot_us = 1e6 * median(hot_times) if hot_times else None
    overhead_us = 1e6 * median([c["total"] - c.get("segment bodies", 0.0) for c in per_call]) - (
        timer_us * median(wrapped_calls))
    return {
        "kind": "overhead",
        "machine": machine_info(device),
        "stage": (f"reference decoder, {cfg.num_layers} layers, hidden {cfg.hidden_size}, whole model on "
                  f"one rank; {_TOKENS} tokens in 2 sequences (bucket {runtime.plan.bucket(_TOKENS)})"
                  + ("; out-variant attention" if out_variant else "")),
        "out_variant": out_variant,
        "graph_mode": runtime.graph_mode,
        "output_slots": output_slots,
        "iters": iters,
        "eager_us": eager_us,
        "eager_ops": ops,
        "eager_us_per_op": eager_us / ops,
        "dynamo_eager_us": dynamo_eager_us,
        "compiled_us": compiled_us,
        "dynamo_us": compiled_us - runtime_us,
        "runtime_us": runtime_us,
        "instrumented_us": instrumented_us,
        "parts_us": parts_us,
        "segments": segments,
        "float_inputs": len(runtime.compiled.scalar_slots),
        "graph_segments": graph_segments,
        "timer_us": timer_us,
        "overhead_us": overhead_us,
        "overhead_us_per_segment": overhead_us / segments,
        "target_us_per_segment": TARGET_US_PER_SEGMENT,
        "noop_us": noop_us,
        "noop_us_per_graph_segment": None if noop_us is None else noop_us / graph_segments,
        "noop_us_per_segment": None if noop_us is None else noop_us / segments,
        "noop_hot_us": hot_us,
        "noop_hot_us_per_graph_segment": None if hot_us is None else hot_us / graph_segments,
        "target_noop_us_per_graph_segment": TARGET_NOOP_US_PER_GRAPH_SEGMENT,
        "part_profile": part_profile,
        "graph_launch": launches,
    }


def profile_parts(runtime: StageRuntime, args: tuple[Any, ...], device: torch.device,
                  categories: Sequence[str] = ("copy-in", "bridge copies"), top: int = 6) -> dict[str, Any]:
    """One instrumented call under ``torch.profiler`` with each part of ``categories`` marked: per
    category, its calls, host µs in all, and the ``top`` ops (ATen ops, CUDA runtime calls) under the
    marks by host µs of their own."""
    marks = {c: f"ppbench::{c}" for c in categories}

    def wrap(category: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        mark = marks.get(category)
        if mark is None:
            return fn

        def marked(*a: Any, **k: Any) -> Any:
            with torch.profiler.record_function(mark):
                return fn(*a, **k)

        return marked

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with runtime.instrumented(wrap):
        runtime(*args)  # binds the marked path
        sync(device)
        with torch.profiler.profile(activities=activities) as prof:
            runtime(*args)
            sync(device)
    found: dict[str, dict[str, Any]] = {c: {"calls": 0, "host_us": 0.0, "ops": Counter()} for c in categories}
    by_mark = {m: c for c, m in marks.items()}
    for e in prof.events():
        category = by_mark.get(e.name)
        if category is None:
            continue
        part = found[category]
        part["calls"] += 1
        part["host_us"] += e.cpu_time_total
        stack = list(e.cpu_children)
        while stack:
            child = stack.pop()
            part["ops"][child.name] += child.self_cpu_time_total
            stack.extend(child.cpu_children)
    return {c: {"calls": p["calls"], "host_us": p["host_us"],
                "ops": [[name, us] for name, us in p["ops"].most_common(top)]} for c, p in found.items()}


def _args_dynamo_passes(runtime: StageRuntime, call: Callable[[], Any]) -> tuple[Any, ...]:
    """The arguments Dynamo hands ``runtime`` during ``call()`` (recorded by the runtime class's
    ``__call__`` meanwhile: Python looks it up on the type)."""
    seen: list[tuple[Any, ...]] = []
    cls = type(runtime)
    original = cls.__call__

    def recording(self: StageRuntime, *args: Any) -> Any:
        seen.append(args)
        return original(self, *args)

    cls.__call__ = recording  # type: ignore[method-assign]
    try:
        call()
    finally:
        cls.__call__ = original  # type: ignore[method-assign]
    if not seen:
        raise RuntimeError("overhead: the compiled stage did not call its StageRuntime")
    return seen[-1]


def _runtime_of_last_compile() -> StageRuntime:
    runtimes = stage_runtimes()
    if not runtimes:
        raise RuntimeError("overhead: the compiled stage built no StageRuntime (did Dynamo fall back?)")
    return runtimes[-1]


def markdown(result: dict[str, Any]) -> str:
    """Per-forward and per-segment figures, and the instrumented breakdown."""
    r = result
    per_seg = r["overhead_us_per_segment"]
    verdict = "within" if per_seg <= r["target_us_per_segment"] else "ABOVE"
    rows = [
        ["eager forward", f"{r['eager_us']:.0f}",
         f"{r['eager_ops']} ATen ops: {r['eager_us_per_op']:.2f} µs/op"],
        ["torch.compile(backend=\"eager\") forward", f"{r['dynamo_eager_us']:.0f}",
         "Dynamo's own cost on this stage, for reference"],
        ["pp_breakable forward (Dynamo + runtime)", f"{r['compiled_us']:.0f}",
         f"Dynamo guards and frame: {r['dynamo_us']:.0f} µs" + _floats_note(r)],
        ["StageRuntime call", f"{r['runtime_us']:.0f}",
         f"{r['segments']} segments ({r['graph_segments']} graph, "
         f"{r['segments'] - r['graph_segments']} break)"],
        ["runtime overhead (without segment bodies)", f"{r['overhead_us']:.0f}",
         f"**{per_seg:.1f} µs per segment** ({verdict} the {r['target_us_per_segment']:.0f} µs target)"],
    ]
    noop = r.get("noop_us")
    if noop is not None:
        noop_seg = r["noop_us_per_graph_segment"]
        target = r["target_noop_us_per_graph_segment"]
        within = "within" if noop_seg <= target else "ABOVE"
        rows.append(["StageRuntime call, segment bodies no-ops (ppcompile's own host time), interleaved",
                     f"{noop:.0f}", f"**{noop_seg:.2f} µs per graph segment** ({within} the {target:.0f} µs "
                     f"target); {r['noop_us_per_segment']:.2f} µs per segment"])
    hot = r.get("noop_hot_us")
    if hot is not None:
        hot_seg = r["noop_hot_us_per_graph_segment"]
        within = "within" if hot_seg <= r["target_noop_us_per_graph_segment"] else "ABOVE"
        rows.append(["the same, back to back (warm caches)", f"{hot:.0f}",
                     f"**{hot_seg:.2f} µs per graph segment** ({within} the target)"])
    launch = launch_lines(r.get("graph_launch"))
    parts = sorted(r["parts_us"].items(), key=lambda kv: -kv[1])
    breakdown = ", ".join(f"{k} {v:.0f}" for k, v in parts)
    return "\n".join([
        f"Stage: {r['stage']}; graphs: {r['graph_mode']}, output_slots {r.get('output_slots', 1)}; "
        f"medians of {r['iters']} calls.",
        "",
        markdown_table(["per forward", "µs", "note"], rows, align="lrl"),
        "",
        f"Instrumented runtime call ({r['instrumented_us']:.0f} µs, timers included), exclusive µs per "
        f"forward: {breakdown}. Runtime overhead is measured within each instrumented call (call - "
        f"segment bodies - {r['timer_us']:.2f} µs per timer), median over calls.",
        "",
        *_profile_lines(r.get("part_profile")),
        *([*launch, ""] if launch else []),
        f"Machine: {describe_machine(r['machine'])}.",
    ])


def _profile_lines(profile: dict[str, Any] | None) -> list[str]:
    """One line per profiled part: calls, host µs, and the ops under it."""
    if not profile:
        return []
    lines = []
    for category, part in profile.items():
        ops = ", ".join(f"`{name}` {us:.0f}" for name, us in part["ops"]) or "none"
        lines.append(f"Profiled call, {category}: {part['calls']} call(s), {part['host_us']:.0f} µs of host "
                     f"time; under it (µs of their own): {ops}.")
    return [*lines, ""]


def _floats_note(r: dict[str, Any]) -> str:
    n = r.get("float_inputs")
    return f" ({n} float attributes passed as 0-d tensors)" if n else ""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--layers", type=int, default=None, help="depth of the tiny stage (default 32)")
    parser.add_argument("--graph-mode", default=None,
                        help="pp_breakable graph_mode (auto|emulate|eager|cuda|none; default: cuda on a GPU, "
                             "else emulate)")
    parser.add_argument("--output-slots", type=int, default=1, help="pp_breakable output_slots (default 1)")
    parser.add_argument("--out-variant", action="store_true",
                        help="the out-variant attention: breaks write their output in place, no bridge copy")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(args.threads)
    result = run_overhead(device, args.iters, args.graph_mode, args.layers, args.output_slots,
                          args.out_variant)
    save_json(args.out / "overhead.json", result)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

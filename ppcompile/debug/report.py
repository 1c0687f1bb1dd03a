"""The stage report: what a compiled stage is made of, what it captures, and what that costs.

:func:`build_report` turns a :class:`~ppcompile.runtime.stage_runtime.StageRuntime` into a JSON-ready
dict (schema in ``docs/debugging.md``); :func:`publish_report` writes it as ``report.json`` and
``report.html`` under the stage's dump folder (when dumping) and emits it as a ``TORCH_TRACE`` artifact.
The backend publishes once at compile time and again after every capture run (capture is lazy: it
happens at the first call that takes the graph path); at interpreter exit every stage that served
forwards since its report was written is published again (:func:`refresh_reports`, also callable on
request), so a dump folder's ``traffic`` counts them all. Each written report says when and after what
(``written``). The memory section is estimated in ``memory.py``.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import importlib.metadata
import json
import logging
import os
import weakref
from typing import TYPE_CHECKING, Any, Literal

import torch

from ppcompile.debug.capture import capture_records
from ppcompile.debug.memory import SegmentMemory, memory_section, segment_memory
from ppcompile.observe.dumps import distributed_rank, emit_artifact, stage_dir, write_graph, write_text
from ppcompile.runtime.program import GraphStep
from ppcompile.symbolic import example_value

if TYPE_CHECKING:
    from ppcompile.runtime.stage_runtime import StageRuntime

__all__ = ["SCHEMA", "build_report", "load_reports", "on_stage_compiled", "publish_report", "refresh_reports"]

SCHEMA = "ppcompile.stage_report/1"

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ compile-time facts
def _segment_memory(runtime: StageRuntime) -> dict[str, SegmentMemory]:
    """Per graph segment, its memory as a function of the bucket (empty for a stage that never graphs,
    and for one a warm restart read back: its split module has no traced values)."""
    split = runtime.compiled.record.split_module
    if split is None or runtime.eager_reason is not None:
        return {}
    if not any(example_value(p) is not None for p in split.graph.find_nodes(op="placeholder")):
        return {}
    return {st.segment.name: segment_memory(_submodule(split, st.segment.name), runtime.token_symbol)
            for st in runtime.program.graph_steps}


def _submodule(split: torch.fx.GraphModule, name: str) -> torch.fx.GraphModule:
    sub = split.get_submodule(name)
    assert isinstance(sub, torch.fx.GraphModule), f"segment {name} is a {type(sub).__name__}"
    return sub


def on_stage_compiled(runtime: StageRuntime) -> None:
    """Called by the backend once a stage's runtime is built: dumps the split module and each
    segment's code, and publishes the compile-time report. Never fails the compile: a problem with the
    debugging output is logged as a warning."""
    dump_dir = runtime.config.dump_dir
    split = runtime.compiled.record.split_module
    try:
        assert split is not None, "a compiled stage keeps its split module"
        write_graph(dump_dir, runtime.name, "split_module.py", split, "final split module")
        for i, seg in enumerate(runtime.segments):
            what = "graph segment (replayed per bucket)" if seg.is_graph else f"break segment ({seg.reason})"
            write_graph(dump_dir, runtime.name, f"segments/{i:02d}.{seg.name}.{seg.kind}.py",
                        _submodule(split, seg.name), f"{what} {seg.name}")
        text = runtime_code(runtime)
        emit_artifact("runtime_code", lambda: text)
        if dump_dir is not None:
            write_text(stage_dir(dump_dir, runtime.name), "runtime_code.txt", text)
        publish_report(runtime, after="compile")
    except Exception:  # debugging output is never worth failing a compile for
        log.warning("%s: could not write the dumps or the report (dump_dir=%r)", runtime.name, dump_dir,
                    exc_info=True)


def runtime_code(runtime: StageRuntime) -> str:
    """The per-call code the runtime generated for the stage (``runtime/codegen.py``): the live path
    and, for a graph mode with graphs, the graph path its executor uses."""
    parts = [f"# ppcompile: code generated for each call of {runtime.name} (it calls the segments of "
             "split_module.py; call_<i> is step i)", "",
             "# live path: graph_mode='none', above the capture cap, autograd on, a stage never graphed",
             str(getattr(runtime.live_forward, "source", "")).rstrip()]
    source = runtime.graph_path_source()
    if source is not None:
        parts += ["", f"# graph path ({runtime.graph_mode} executor; bound once per bucket b, replay_<i> "
                  "replays step i at b)", source.rstrip()]
    return "\n".join(parts) + "\n"


# ------------------------------------------------------------------------------ the report
def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _config(runtime: StageRuntime) -> dict[str, Any]:
    return runtime.config.as_dict()


def _traffic(runtime: StageRuntime) -> dict[str, Any]:
    """The live token counts the stage served so far and the padding they cost with its buckets."""
    from ppcompile.planning.planner import evaluate_ladder

    traffic = runtime.traffic
    if not traffic.total:
        return {"forwards": 0, "traffic_weighted_waste": None, "graphed_fraction": None, "counts": {}}
    scored = evaluate_ladder(traffic, runtime.plan.sizes, max_padding_factor=runtime.plan.max_padding_factor)
    return {
        "forwards": traffic.total,
        "traffic_weighted_waste": round(scored.padding_per_served_token, 4),
        "graphed_fraction": round(scored.graphed_fraction, 4),
        "counts": {str(n): c for n, c in sorted(traffic.counts().items())},
    }


def _output_ring(runtime: StageRuntime) -> dict[str, Any] | None:
    """The ring of output slots (``output_slots`` > 1): what it copies per forward and what a slot holds."""
    ring = runtime.program.output_ring
    if ring is None:
        return None
    held = [i.ring for i in runtime.instances() if i.ring is not None]
    return {
        "slots": ring.depth,
        "outputs": [runtime.program.producer(s) for s in ring.slots],
        "bytes_per_slot": (sum(t.untyped_storage().nbytes() for t in held[0].slots[0].buffers)
                           if held else None),
        "copies_per_forward": len(ring.slots),
    }


def _padding(runtime: StageRuntime) -> dict[str, Any]:
    plan = runtime.plan
    rows = plan.padding_table()
    graphed = [(n, b) for n, b, _ in rows if b is not None]
    live = sum(n for n, _ in graphed)
    padded = sum(b - n for n, b in graphed)
    worst = max(rows, key=lambda r: r[2], default=None)  # None: no bucket (every size refused)
    per_bucket = []
    lo = 1
    for b in plan.sizes:
        served = [n for n in range(lo, b + 1) if plan.bucket(n) == b]
        per_bucket.append({
            "bucket": b,
            "serves": [served[0], served[-1]] if served else None,
            "max_waste": round((b - served[0]) / served[0], 4) if served else None,
        })
        lo = b + 1
    return {
        "sizes": list(plan.sizes),
        "cap": plan.cap,
        "max_padding_factor": plan.max_padding_factor,
        "table": [[n, b, round(w, 4)] for n, b, w in rows],
        "per_bucket": per_bucket,
        "summary": {
            "mean_waste": round(sum(w for _, b, w in rows if b is not None) / max(1, len(graphed)), 4),
            "token_weighted_waste": round(padded / live, 4) if live else 0.0,
            "max_waste": None if worst is None else round(worst[2], 4),
            "max_waste_at": None if worst is None else worst[0],
            "eager_at_or_below_cap": sum(1 for _, b, _ in rows if b is None),
        },
    }


def _whole_stage(runtime: StageRuntime) -> dict[str, Any]:
    """Whole-stage graphs: the buckets served whole and the metadata padded, or why there are none."""
    plan = runtime.compiled.whole
    if plan is None:
        return {"buckets": [], "reason": runtime.compiled.whole_reason}
    wholes = [s.whole for s in runtime.instances() if s.whole is not None]
    return {
        "buckets": [b for b in runtime.compiled.plan.sizes if b <= plan.max_tokens],
        "max_requests": plan.max_requests,
        "ops": list(plan.ops),
        "metadata": {i.name: {"rows": i.metadata.rows.value, "pad": i.metadata.pad}
                     for i in plan.inputs if i.metadata is not None},
        "captured": sorted({b for w in wholes for b in w.captured_buckets}),
        "failed": {str(b): why for w in wholes for b, why in w.failed_buckets.items()},
    }


def _buffers(runtime: StageRuntime) -> tuple[list[dict[str, Any]], dict[int, str]]:
    program = runtime.program
    names: dict[int, str] = {}
    buffers = []
    for slot, plan in program.buffers.items():
        buf = plan.spec
        names[slot] = buf.name
        buffers.append({
            "name": buf.name,
            "role": buf.role,
            "shape": list(buf.shape),
            "dtype": _dtype(buf.dtype),
            "device": str(buf.device),
            "token_dims": list(buf.token_dims),
            "bytes": buf.nbytes,
            "shares_memory_with": None if plan.shares_with is None else
            program.buffers[plan.shares_with].spec.name,
            "read_by": [st.segment.name for st in program.graph_steps
                        if any(r.slot == slot for r in st.args)],
            "written_by": [st.segment.name for st in program.break_steps
                           if st.copies is not None and slot in st.copies.slots],
        })
    return buffers, names


def _segments(runtime: StageRuntime, buffer_names: dict[int, str],
              memory: dict[str, SegmentMemory]) -> list[Any]:
    out = []
    cap = runtime.plan.cap
    for step in runtime.program.steps:
        seg = step.segment
        reason = seg.reason
        mem = memory.get(seg.name)
        copied: tuple[int, ...]
        in_place: tuple[int, ...]
        written: tuple[int, ...]
        if isinstance(step, GraphStep):
            copied, in_place, written = (), (), step.writes_buffers
        else:
            copied, in_place, written = step.copies.slots if step.copies else (), step.in_place, ()
        out.append({
            "index": step.index,
            "name": seg.name,
            "kind": seg.kind,
            "nodes": seg.num_nodes,
            "layer_ids": list(seg.layer_ids),
            "token_local_regions": list(seg.token_local_regions),
            "break_reason": None if reason is None else {
                "kind": reason.kind.value,
                "op": reason.op,
                "detail": reason.detail,
                "stack_trace": reason.stack_trace,
            },
            "reads_static": [buffer_names[r.slot] for r in step.args
                             if seg.is_graph and r.slot in buffer_names],
            "writes_static": [buffer_names[s] for s in copied if s in buffer_names],
            "writes_in_place": [*(runtime.program.producer(s) for s in in_place),
                                *(buffer_names[s] for s in written if s in buffer_names)],
            "output_bytes_at_cap": mem.output_bytes(cap) if mem else None,
            "transient_bytes_at_cap": mem.transient_bytes(cap) if mem else None,
        })
    return out


def package_version() -> str:
    """ppcompile's installed version (its distribution's metadata), or ``"unknown"`` when not installed."""
    try:
        return importlib.metadata.version("ppcompile")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_report(runtime: StageRuntime) -> dict[str, Any]:
    """The stage report of ``runtime`` as a JSON-ready dict (captures so far included)."""
    record = runtime.compiled.record
    records = capture_records(runtime)
    buffers, names = _buffers(runtime)
    memory = _segment_memory(runtime)
    return {
        "schema": SCHEMA,
        "stage_graph": runtime.name,
        "rank": distributed_rank(),
        "versions": {"ppcompile": package_version(), "torch": torch.__version__},
        "graph_mode": runtime.graph_mode,
        "eager_reason": runtime.eager_reason,
        "token_symbol": None if runtime.token_symbol is None else str(runtime.token_symbol),
        "layer_ids": list(runtime.layer_ids),
        "token_local_regions": list(dict.fromkeys(
            r for s in runtime.segments for r in s.token_local_regions)),
        "config": _config(runtime),
        "segments": _segments(runtime, names, memory),
        "static_buffers": buffers,
        "buckets": _padding(runtime),
        "traffic": _traffic(runtime),
        "output_ring": _output_ring(runtime),
        "whole_stage": _whole_stage(runtime),
        "fall_offs": runtime.fall_offs(),
        "recompile_budget": {"frame_compile": record.frame_compile, "limit": record.recompile_limit,
                             "module": record.module, "recompile_of": record.recompile_of,
                             "recompile_reason": record.recompile_reason},
        "captures": {
            "count": sum(r.graphs for r in records if r.failed is None),
            "runs": [dataclasses.asdict(r) for r in records],
            "captured": bool(records),
        },
        "memory": memory_section(runtime, buffers, memory, records),
        "region_traces": {"calls": sum(record.region_traces.values()),
                          "subgraphs": len(record.region_traces), "by_subgraph": dict(record.region_traces)},
        "pass_times_ms": {k: round(1e3 * v, 3) for k, v in record.pass_times.items()},
        "compile_times_s": {k: round(v, 4) for k, v in record.compile_times.items()},
        "segment_compiles": [dataclasses.asdict(r) for r in record.segment_compiles],
    }


Moment = Literal["compile", "capture", "exit", "request"]
# Runtimes whose report was published, and (capture runs, forwards served) as of then: how the next
# publish names its moment, and which reports are stale at exit.
_published: weakref.WeakKeyDictionary[StageRuntime, tuple[int, int]] = weakref.WeakKeyDictionary()


def _usage(runtime: StageRuntime) -> tuple[int, int]:
    return len(runtime.capture_records()), runtime.traffic.total


def publish_report(runtime: StageRuntime, after: Moment | None = None) -> str | None:
    """Writes ``report.json`` and ``report.html`` for ``runtime`` when dumping, and emits the report as a
    ``TORCH_TRACE`` artifact; returns the stage's dump folder, if any. ``after`` names the moment the
    report's ``written`` records (default: ``capture`` when a capture run ended since the last publish,
    else ``request``)."""
    usage = _usage(runtime)
    if after is None:
        last = _published.get(runtime)
        after = "capture" if last is not None and usage[0] > last[0] else "request"
    _published[runtime] = usage
    _register_exit_refresh()
    cache: list[dict[str, Any]] = []

    def report() -> dict[str, Any]:
        if not cache:
            now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            cache.append({**build_report(runtime), "written": {"at": now, "after": after}})
        return cache[0]

    emit_artifact("report", lambda: json.dumps(report(), default=str), encoding="json",
                  compile_id=runtime.compiled.record.compile_id)
    dump_dir = runtime.config.dump_dir
    if dump_dir is None:
        return None
    from ppcompile.debug.html import render_html

    folder = stage_dir(dump_dir, runtime.name)
    write_text(folder, "report.json", json.dumps(report(), indent=1, default=str) + "\n")
    write_text(folder, "report.html", render_html(report()))
    return folder


def refresh_reports(after: Moment = "request") -> list[str]:
    """Publishes again the report of every live stage that served a forward or captured since its report
    was written, when its dump folder is still there (a folder someone removed is not made again);
    returns the folders written. Runs at interpreter exit; call it to look at the reports mid-run."""
    written = []
    for runtime, usage in list(_published.items()):
        dump_dir = runtime.config.dump_dir
        if dump_dir is None or usage == _usage(runtime):
            continue
        if not os.path.isdir(stage_dir(dump_dir, runtime.name)):
            continue
        try:
            folder = publish_report(runtime, after=after)
        except Exception:  # at exit, nothing is worth a traceback over a report
            log.warning("%s: could not rewrite the stage report", runtime.name, exc_info=True)
            continue
        if folder is not None:
            written.append(folder)
    return written


_exit_refresh: list[bool] = []


def _register_exit_refresh() -> None:
    if not _exit_refresh:
        _exit_refresh.append(True)
        atexit.register(refresh_reports, "exit")


def load_reports(path: str) -> list[tuple[str, dict[str, Any]]]:
    """``(file, report)`` for ``path`` (a report.json) or every report.json under ``path``, sorted."""
    if os.path.isfile(path):
        files = [path]
    elif os.path.isdir(path):
        files = sorted(os.path.join(d, "report.json") for d, _, fs in os.walk(path) if "report.json" in fs)
    else:
        raise FileNotFoundError(f"no such file or folder: {path!r}")
    out = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            data = json.load(fh)
        if data.get("schema") != SCHEMA:
            raise ValueError(f"{f}: not a ppcompile stage report (schema {data.get('schema')!r}, "
                             f"expected {SCHEMA!r})")
        out.append((f, data))
    return out

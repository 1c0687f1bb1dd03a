"""A stage report as plain-text tables for the terminal (``python -m ppcompile report DIR``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ppcompile.debug.capture import buffer_bytes, format_bytes
from ppcompile.records import break_kind_info

__all__ = ["format_ids", "format_report", "format_table"]

_MAX_CELL = 56


def _cell(value: Any) -> str:
    text = "" if value is None else str(value)
    return text if len(text) <= _MAX_CELL else text[: _MAX_CELL - 3] + "..."


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    """Columns padded to their widest cell; column indices in ``right`` are right-aligned. Long cells are
    cut, except in the last column (nothing follows it)."""
    last = len(headers) - 1
    cells = [[_cell(c) if i < last else str(c) for i, c in enumerate(row)] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(row: Sequence[str]) -> str:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(list(headers)), rule, *(line(r) for r in cells)])


def format_ids(ids: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "-"


def _segments(report: dict[str, Any]) -> str:
    rows = []
    for s in report["segments"]:
        r = s["break_reason"]
        why = "" if r is None else f"{r['kind']}: {r['op']}" + (f" ({r['detail']})" if r["detail"] else "")
        mem = format_bytes(s["output_bytes_at_cap"]) if s["output_bytes_at_cap"] is not None else ""
        rows.append([s["index"], s["name"], s["kind"], s["nodes"], format_ids(s["layer_ids"]),
                     mem, why])
    return format_table(["#", "segment", "kind", "nodes", "layers", "out@cap", "break reason"], rows,
                        right=(0, 3, 5))


def _break_kinds(report: dict[str, Any]) -> list[str]:
    """What each kind of break in the report means (its ``records.BREAK_KINDS`` description), in order of
    first appearance; nothing without breaks."""
    kinds = dict.fromkeys(s["break_reason"]["kind"] for s in report["segments"] if s["break_reason"])
    lines = [f"  {k}: {info.description}" for k in kinds if (info := break_kind_info(k)) is not None]
    return ["break kinds:", *lines] if lines else []


def _buffers(report: dict[str, Any]) -> str:
    rows = [[b["name"], b["role"], "x".join(map(str, b["shape"])), b["dtype"], buffer_bytes(b),
             ",".join(b["written_by"]) or "copy-in", ",".join(b["read_by"])]
            for b in report["static_buffers"]]
    if not rows:
        return "(no static buffers)"
    return format_table(["static buffer", "role", "shape@cap", "dtype", "bytes", "written by", "read by"],
                        rows, right=(4,))


def _buckets(report: dict[str, Any]) -> str:
    runs = report["captures"]["runs"]
    captured = {b["bucket"]: b for b in runs[-1]["buckets"]} if runs else {}
    rows = []
    for p in report["buckets"]["per_bucket"]:
        served = p["serves"]
        c = captured.get(p["bucket"])
        rows.append([
            p["bucket"],
            "-" if served is None else f"{served[0]}-{served[1]}",
            "-" if p["max_waste"] is None else f"{100 * p['max_waste']:.0f}%",
            "" if c is None else f"{1e3 * c['seconds']:.1f}",
            "" if c is None else format_bytes(c["output_bytes"]),
            "" if c is None or c["pool_bytes"] is None else format_bytes(c["pool_bytes"]),
        ])
    return format_table(["bucket", "serves tokens", "max waste", "capture ms", "outputs", "CUDA pool"], rows,
                        right=(0, 1, 2, 3, 4, 5))


def format_report(report: dict[str, Any], path: str = "") -> str:
    """The whole report: a summary, then segments, static buffers and buckets as tables."""
    cfg, mem, caps, b = report["config"], report["memory"], report["captures"], report["buckets"]
    rank = "" if report["rank"] is None else f", rank {report['rank']}"
    s = b["summary"]
    lines = [
        f"== {report['stage_graph']}{rank}" + (f"  ({path})" if path else ""),
        f"graph mode {report['graph_mode']}, segment compiler {cfg['segment_compiler']}, "
        f"global layers {format_ids(report['layer_ids'])}, token symbol {report['token_symbol']}",
    ]
    if report["eager_reason"]:
        lines.append(f"ALWAYS EAGER: {report['eager_reason']}")
    done = [r for r in caps["runs"] if r["failed"] is None]
    failed = [r for r in caps["runs"] if r["failed"] is not None]
    if caps["runs"]:
        fail = f", {len(failed)} FAILED: {failed[-1]['failed']}" if failed else ""
        lines.append(f"captures: {caps['count']} graphs in {sum(r['seconds'] for r in done):.2f} s "
                     f"({len(done)} run(s){fail})")
    else:
        lines.append("captures: none yet (graphs are captured at the first graph-path call)")
    lines.append(
        f"memory: static buffers {format_bytes(mem['static_buffer_bytes'])}, estimated graph memory "
        f"{format_bytes(mem['estimated_graph_bytes'])}, graph outputs held "
        f"{format_bytes(mem['captured_output_bytes'])}, measured (CUDA) "
        f"{format_bytes(mem['measured_graph_bytes'])}")
    lines.append(
        f"buckets: {len(b['sizes'])} up to {b['cap']}, max_padding_factor {b['max_padding_factor']:g}; "
        f"padding waste {100 * s['token_weighted_waste']:.1f}% token-weighted, "
        + ("no bucket" if s["max_waste"] is None else
           f"worst {100 * s['max_waste']:.0f}% at {s['max_waste_at']} tokens")
        + f", {s['eager_at_or_below_cap']} count(s) at or below the cap run eagerly")
    traffic = report.get("traffic") or {}
    if traffic.get("forwards"):
        lines.append(
            f"traffic: {traffic['forwards']} forwards served, padding waste "
            f"{100 * traffic['traffic_weighted_waste']:.1f}% per live token, "
            f"{100 * traffic['graphed_fraction']:.0f}% graphed")
    whole = report.get("whole_stage") or {}
    if whole.get("buckets"):
        lost = f", FAILED at {sorted(whole['failed'])}" if whole["failed"] else ""
        lines.append(f"whole-stage graphs: buckets {whole['buckets']} (captured {whole['captured']}"
                     f"{lost}), capturable breaks {', '.join(whole['ops'])}")
    elif whole.get("reason"):
        lines.append(f"whole-stage graphs: none ({whole['reason']})")
    compile_s = report.get("compile_times_s") or {}
    if compile_s:
        parts = [f"{k} {v:.2f} s" for k, v in compile_s.items() if not k.startswith("pass.")]
        lines.append("compile: " + ", ".join(parts))
    lines += ["", _segments(report), *_break_kinds(report), "", _buffers(report), "", _buckets(report)]
    return "\n".join(lines)

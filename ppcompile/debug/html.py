"""``report.html``: one self-contained page (inline CSS, SVG and script; nothing fetched) for a stage report.

The page draws the stage as a timeline of segments coloured by kind (hover: a tooltip; click: details with
break reason, source line and static buffers), the static buffers (hover a row: the segments that read or
write it light up), padding waste per token count, capture time per bucket, and the pass times. The
pictures are SVG drawn here, so the page reads the same with scripts off; the script only adds the
details panel, highlighting and the padding read-out.
"""

from __future__ import annotations

import html
import json
import math
from typing import Any

from ppcompile.debug.capture import buffer_bytes, format_bytes, owned_buffer_bytes
from ppcompile.records import BREAK_KINDS

__all__ = ["KIND_COLORS", "render_html"]

GRAPH_COLOR = "#4e79a7"
# A break's colour: its kind's row of records.BREAK_KINDS, keyed by the kind's value as reports store it.
KIND_COLORS = {
    "graph": GRAPH_COLOR,
    **{kind.value: row.color for kind, row in BREAK_KINDS.items()},
    "other": "#9c755f",  # a kind no BreakKind has (a report another version wrote)
}
_W = 1120  # drawing width of the SVGs, px

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;
  background:#f6f7f9;color:#1d2733}
header{background:#1d2733;color:#fff;padding:16px 28px}
header h1{margin:0;font-size:20px;font-weight:600}
header .sub{color:#aeb9c6;font-size:13px;margin-top:4px}
main{padding:8px 28px 28px;max-width:1180px}
section{background:#fff;border:1px solid #dde2e8;border-radius:8px;padding:14px 18px;margin-top:16px}
h2{font-size:16px;margin:0 0 10px}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin-top:16px}
.card{background:#fff;border:1px solid #dde2e8;border-radius:8px;padding:10px 14px;flex:1 1 110px}
.card .v{font-size:20px;font-weight:600}.card .k{color:#5b6776;font-size:12px}
.banner{background:#fdecea;border:1px solid #e15759;border-radius:8px;padding:10px 14px;margin-top:16px}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{text-align:left;padding:4px 8px;border-bottom:1px solid #edf0f3;vertical-align:top}
th{color:#5b6776;font-weight:600}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.nw{white-space:nowrap}
tr.hl td{background:#fff4d6}
.legend span{display:inline-block;margin-right:14px;font-size:12px}
.legend i{display:inline-block;width:12px;height:12px;border-radius:2px;margin-right:5px;vertical-align:-2px}
svg text{font:11px system-ui,sans-serif;fill:#1d2733}
.seg{cursor:pointer;stroke:#fff;stroke-width:1}
.seg.hl,.seg.sel{stroke:#1d2733;stroke-width:2.5}
#details{margin-top:10px;padding:10px 12px;background:#f6f7f9;border-radius:6px;min-height:40px}
#details pre{white-space:pre-wrap;font-size:12px;background:#fff;border:1px solid #dde2e8;padding:6px;
  margin:6px 0 0}
.muted{color:#5b6776}
code{background:#eef1f4;padding:0 3px;border-radius:3px}
"""

_JS = r"""
const R = JSON.parse(document.getElementById('report-data').textContent);
const esc = s => String(s).replace(/[&<>"]/g, c => ({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;'}[c]));
const fmtB = n => n == null ? '-' : n < 1024 ? n + ' B' : n < 1048576 ? (n/1024).toFixed(1) + ' KiB' :
  n < 1073741824 ? (n/1048576).toFixed(1) + ' MiB' : (n/1073741824).toFixed(2) + ' GiB';
function showSegment(i) {
  const s = R.segments[i];
  document.querySelectorAll('.seg').forEach(e => e.classList.toggle('sel', +e.dataset.index === i));
  let h = '<b>' + esc(s.name) + '</b> &middot; ' + esc(s.kind) + ' segment &middot; ' + s.nodes + ' nodes';
  if (s.layer_ids.length) h += ' &middot; global layers ' + esc(s.layer_ids.join(', '));
  if ((s.token_local_regions || []).length)
    h += '<div>Declared token-local: ' + esc(s.token_local_regions.join(', ')) + '</div>';
  const r = s.break_reason;
  if (r) h += '<div>Break: <b>' + esc(r.kind) + '</b> at <code>' + esc(r.op) + '</code>' +
    (r.detail ? ' &mdash; ' + esc(r.detail) : '') + '</div>' +
    (r.stack_trace ? '<pre>' + esc(r.stack_trace.trim()) + '</pre>' : '');
  const codes = xs => xs.map(x => '<code>' + esc(x) + '</code>').join(' ');
  if (s.reads_static.length) h += '<div>Reads static buffers: ' + codes(s.reads_static) + '</div>';
  if (s.writes_static.length)
    h += '<div>Writes static buffers (copied): ' + codes(s.writes_static) + '</div>';
  if ((s.writes_in_place || []).length)
    h += '<div>Writes in place (no bridge): ' + codes(s.writes_in_place) + '</div>';
  if (s.output_bytes_at_cap != null) h += '<div class="muted">At the cap: outputs ' +
    fmtB(s.output_bytes_at_cap) + ', peak intermediates ' + fmtB(s.transient_bytes_at_cap) + '</div>';
  const d = document.getElementById('details'); d.className = ''; d.innerHTML = h;
}
document.querySelectorAll('.seg').forEach(e =>
  e.addEventListener('click', () => showSegment(+e.dataset.index)));
document.querySelectorAll('tr[data-segs]').forEach(tr => {
  const names = tr.dataset.segs.split(' ');
  const on = v => { tr.classList.toggle('hl', v);
    document.querySelectorAll('.seg').forEach(e => {
      if (names.includes(e.dataset.name)) e.classList.toggle('hl', v); }); };
  tr.addEventListener('mouseenter', () => on(true)); tr.addEventListener('mouseleave', () => on(false));
});
const pad = document.getElementById('padplot');
if (pad) {
  const info = document.getElementById('padinfo'), cap = R.buckets.cap;
  const x0 = +pad.dataset.x0, x1 = +pad.dataset.x1, lmax = Math.log2(Math.max(2, cap));
  pad.addEventListener('mousemove', ev => {
    const box = pad.getBoundingClientRect();
    const x = (ev.clientX - box.left) * (pad.viewBox.baseVal.width / box.width);
    const n = Math.max(1, Math.min(cap, Math.round(Math.pow(2, (x - x0) / (x1 - x0) * lmax))));
    const row = R.buckets.table[n - 1];
    info.textContent = row[1] == null ? n + ' tokens: eager (bucket would pad more than max_padding_factor)'
      : n + ' tokens -> bucket ' + row[1] + ', ' + (row[1] - n) + ' padded rows (' +
        (100 * row[2]).toFixed(1) + '% waste)';
  });
}
const m = /segment=(\d+)/.exec(location.hash);  // report.html#segment=3 opens that segment's details
if (m && R.segments[+m[1]]) showSegment(+m[1]);
document.body.dataset.ready = '1';
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _text_width(text: str) -> float:
    """A generous estimate of ``text``'s width in px at the SVGs' 11 px font (about 6 px a character)."""
    return 6.6 * len(text)


def _fit(x: float, text: str, width: float = _W) -> tuple[float, str]:
    """``(x, text-anchor)`` of a label centred on ``x``, or anchored at the edge of the SVG it would cross."""
    half = _text_width(text) / 2
    if x + half > width - 2:
        return width - 2, "end"
    if x - half < 2:
        return 2, "start"
    return x, "middle"


def _color(seg: dict[str, Any]) -> str:
    if seg["kind"] == "graph":
        return GRAPH_COLOR
    reason = seg.get("break_reason") or {}
    return KIND_COLORS.get(reason.get("kind", "other"), KIND_COLORS["other"])


def _tooltip(seg: dict[str, Any]) -> str:
    lines = [f"{seg['name']}: {seg['kind']} segment, {seg['nodes']} nodes"]
    if seg["layer_ids"]:
        lines.append("global layers " + ", ".join(map(str, seg["layer_ids"])))
    if seg.get("token_local_regions"):
        lines.append("declared token-local: " + ", ".join(seg["token_local_regions"]))
    r = seg.get("break_reason")
    if r:
        lines.append(f"break: {r['kind']} at {r['op']}" + (f" ({r['detail']})" if r["detail"] else ""))
    if seg["reads_static"]:
        lines.append("reads static: " + ", ".join(seg["reads_static"]))
    if seg["writes_static"]:
        lines.append("writes static buffers (copied): " + ", ".join(seg["writes_static"]))
    if seg.get("writes_in_place"):
        lines.append("writes in place (no bridge): " + ", ".join(seg["writes_in_place"]))
    return "\n".join(lines)


def _timeline(report: dict[str, Any]) -> str:
    segs = report["segments"]
    if not segs:
        return "<p class='muted'>No segments.</p>"
    n = len(segs)
    gap = 2.0
    min_w = min(18.0, _W / (2 * n))
    spare = _W - n * (min_w + gap)
    total = sum(max(1, s["nodes"]) for s in segs)
    y, h = 26, 46
    xs, parts = [], []
    x = 0.0
    breaks = [s for s in segs if s["kind"] == "break" and s["layer_ids"]]
    every = max(1, math.ceil(30 * len(breaks) / _W))  # label every k-th break: ~30 px per label
    labelled = {s["index"] for s in breaks[::every]}
    for s in segs:
        w = min_w + spare * max(1, s["nodes"]) / total
        xs.append((x, w))
        label = ""
        if s["kind"] == "graph" and w > 70:
            label = f"{s['name']} · {s['nodes']} nodes"
        elif s["kind"] == "graph" and w > 34:
            label = s["name"].replace("submod_", "#")
        text = (f"<text x='{x + w / 2:.1f}' y='{y + h / 2 + 4}' text-anchor='middle' "
                f"style='fill:#fff;pointer-events:none'>{_e(label)}</text>") if label else ""
        layers = ""
        if s["index"] in labelled:
            tag = "L" + ",".join(map(str, s["layer_ids"]))
            lx, anchor = _fit(x + w / 2, tag)
            layers = f"<text x='{lx:.1f}' y='{y - 6}' text-anchor='{anchor}'>{_e(tag)}</text>"
        parts.append(
            f"<g><rect class='seg' data-index='{s['index']}' data-name='{_e(s['name'])}' x='{x:.1f}' y='{y}' "
            f"width='{w:.1f}' height='{h}' rx='3' fill='{_color(s)}'><title>{_e(_tooltip(s))}</title></rect>"
            f"{text}{layers}</g>")
        x += w + gap
    # Bridges: a break segment's output copied into a static buffer that a later graph segment reads.
    index = {s["name"]: i for i, s in enumerate(segs)}
    arcs = []
    for buf in report["static_buffers"]:
        for src in buf["written_by"]:
            for dst in buf["read_by"]:
                if src in index and dst in index:
                    (sx, sw), (dx, dw) = xs[index[src]], xs[index[dst]]
                    a, b = sx + sw / 2, dx + dw / 2
                    depth = min(34.0, 10 + abs(b - a) / 8)
                    arcs.append(f"<path d='M{a:.1f},{y + h} Q{(a + b) / 2:.1f},{y + h + depth:.1f} {b:.1f},"
                                f"{y + h}' fill='none' stroke='#8a94a3' stroke-dasharray='3,2'>"
                                f"<title>{_e(buf['name'])}: {_e(src)} -> {_e(dst)}</title></path>")
    height = y + h + 44
    kinds = {(s.get("break_reason") or {}).get("kind", "other") for s in segs if s["kind"] == "break"}
    legend_kinds = ["graph", *sorted(kinds)]
    legend = "".join(f"<span><i style='background:{KIND_COLORS.get(k, KIND_COLORS['other'])}'></i>"
                     f"{_e(k if k == 'graph' else 'break: ' + k)}</span>" for k in legend_kinds)
    legend += "<span class='muted'>- - static bridge (break output read by a later graph)</span>"
    return (f"<div class='legend'>{legend}</div><svg id='timeline' viewBox='0 0 {_W} {height}' "
            f"width='100%' role='img' aria-label='segment timeline'>{''.join(parts)}{''.join(arcs)}</svg>"
            "<div id='details' class='muted'>Click a segment for its details; hover for a summary.</div>")


def _padding_plot(report: dict[str, Any]) -> str:
    b = report["buckets"]
    cap, table = b["cap"], b["table"]
    x0, x1, y0, y1 = 48.0, _W - 28.0, 14.0, 214.0
    lmax = math.log2(max(2, cap))
    ymax = max(0.25, max((r[2] for r in table), default=0.0))
    ymax = math.ceil(ymax * 4) / 4

    def px(n: float) -> float:
        return x0 + (x1 - x0) * math.log2(n) / lmax

    def py(w: float) -> float:
        return y1 - (y1 - y0) * w / ymax

    parts = []
    for k in range(int(ymax * 4) + 1):  # horizontal grid every 25%
        yy = py(k / 4)
        parts.append(f"<line x1='{x0}' x2='{x1}' y1='{yy:.1f}' y2='{yy:.1f}' stroke='#edf0f3'/>"
                     f"<text x='{x0 - 6}' y='{yy + 4:.1f}' text-anchor='end'>{k * 25}%</text>")
    p = 0
    while 2**p <= cap:
        parts.append(f"<text x='{px(2**p):.1f}' y='{y1 + 16}' text-anchor='middle'>{2**p}</text>")
        p += 1
    run_start = None
    for n, bucket, _ in [*table, [cap + 1, 1, 0]]:  # shade token counts that run eagerly
        if bucket is None and run_start is None:
            run_start = n
        elif bucket is not None and run_start is not None:
            a, z = px(max(1, run_start - 0.5)), px(min(cap, n - 0.5))
            parts.append(f"<rect x='{a:.1f}' y='{y0}' width='{max(1.5, z - a):.1f}' height='{y1 - y0}' "
                         f"fill='#e15759' opacity='0.15'><title>{run_start}-{n - 1} tokens run eagerly"
                         "</title></rect>")
            run_start = None
    pts: list[str] = []
    for n, bucket, w in table:
        if bucket is None:
            if pts:
                parts.append(f"<polyline points='{' '.join(pts)}' fill='none' stroke='{GRAPH_COLOR}' "
                             "stroke-width='1.5'/>")
                pts = []
            continue
        first = n == 1 or table[n - 2][1] != bucket
        if not first and bucket != n and n % max(1, n // 128):
            continue  # about 128 points per octave: the log axis has no room for more
        pts.append(f"{px(n):.1f},{py(w):.1f}")
    if pts:
        parts.append(f"<polyline points='{' '.join(pts)}' fill='none' stroke='{GRAPH_COLOR}' "
                     "stroke-width='1.5'/>")
    for s in b["sizes"]:
        parts.append(f"<line x1='{px(s):.1f}' x2='{px(s):.1f}' y1='{y1}' y2='{y1 + 5}' stroke='#1d2733'>"
                     f"<title>bucket {s}</title></line>")
    parts.append(f"<line x1='{x0}' x2='{x1}' y1='{y1}' y2='{y1}' stroke='#1d2733'/>")
    parts.append(f"<text x='{(x0 + x1) / 2:.1f}' y='{y1 + 32}' text-anchor='middle'>live token count "
                 f"(log scale; ticks below the axis are buckets; above {cap}: eager)</text>")
    s = b["summary"]
    worst = ("no bucket" if s["max_waste"] is None else
             f"worst {100 * s['max_waste']:.0f}% at {s['max_waste_at']} tokens")
    caption = (f"Padding waste = padded rows / live rows. Token-weighted waste "
               f"{100 * s['token_weighted_waste']:.1f}%, {worst}; "
               f"{s['eager_at_or_below_cap']} counts at or below the cap run eagerly (shaded).")
    return (f"<p class='muted'>{_e(caption)}</p><svg id='padplot' data-x0='{x0}' data-x1='{x1}' "
            f"viewBox='0 0 {_W} {y1 + 40}' width='100%' role='img' aria-label='padding waste'>"
            f"{''.join(parts)}</svg><div id='padinfo' class='muted'>Move the mouse over the plot for a "
            "token count's bucket and waste.</div>")


def _capture_plot(report: dict[str, Any]) -> str:
    runs = report["captures"]["runs"]
    if not runs:
        return ("<p class='muted'>Not captured yet: graphs are captured at the first call that takes the "
                "graph path, and this report is rewritten then.</p>")
    run = runs[-1]
    buckets = sorted(run["buckets"], key=lambda b: b["bucket"])
    if not buckets:
        return f"<p class='muted'>The last capture run failed: {_e(run['failed'])}</p>"
    tmax = max(b["seconds"] for b in buckets) or 1e-9
    top = f"{1e3 * tmax:.0f} ms" if tmax >= 0.01 else f"{1e3 * tmax:.2g} ms"  # the time axis's label
    x0, x1, y0, y1 = max(48.0, _text_width(top) + 10), _W - 12.0, 10.0, 150.0
    step = (x1 - x0) / len(buckets)
    bars = []
    for i, b in enumerate(buckets):
        hh = (y1 - y0) * b["seconds"] / tmax
        tip = (f"bucket {b['bucket']}: {b['graphs']} graphs in {1e3 * b['seconds']:.1f} ms, outputs "
               f"{format_bytes(b['output_bytes'])}"
               + ("" if b["pool_bytes"] is None else f", CUDA pool +{format_bytes(b['pool_bytes'])}"))
        bars.append(f"<rect x='{x0 + i * step + 1:.1f}' y='{y1 - hh:.1f}' width='{max(1.0, step - 2):.1f}' "
                    f"height='{hh:.1f}' fill='{GRAPH_COLOR}'><title>{_e(tip)}</title></rect>")
        if len(buckets) <= 24 or i % max(1, len(buckets) // 12) == 0:
            bx, anchor = _fit(x0 + (i + 0.5) * step, str(b["bucket"]))
            bars.append(f"<text x='{bx:.1f}' y='{y1 + 14}' text-anchor='{anchor}'>{b['bucket']}</text>")
    bars.append(f"<text x='{x0 - 6:.1f}' y='{y0 + 8}' text-anchor='end'>{_e(top)}</text>"
                f"<line x1='{x0}' x2='{x1}' y1='{y1}' y2='{y1}' stroke='#1d2733'/>")
    caption = (f"{run['graphs']} graphs ({run['graph_mode']}) in {run['seconds']:.2f} s; graph outputs hold "
               f"{format_bytes(run['output_bytes'])}"
               + ("" if run["measured_bytes"] is None
                  else f"; CUDA pool +{format_bytes(run['measured_bytes'])}")
               + (f". {len(runs)} capture runs (one per module instance)." if len(runs) > 1 else "."))
    return (f"<p class='muted'>{_e(caption)}</p><svg id='captureplot' viewBox='0 0 {_W} {y1 + 22}' "
            f"width='100%' role='img' aria-label='capture time per bucket'>{''.join(bars)}</svg>")


def _buffer_table(report: dict[str, Any]) -> str:
    rows = []
    for b in report["static_buffers"]:
        segs = " ".join(b["read_by"] + b["written_by"])
        rows.append(f"<tr data-segs='{_e(segs)}'><td><code>{_e(b['name'])}</code></td>"
                    f"<td>{_e(b['role'])}</td>"
                    f"<td class='nw'>{_e(tuple(b['shape']))}</td><td>{_e(b['dtype'])}</td>"
                    f"<td class='num'>{_e(buffer_bytes(b))}</td>"
                    f"<td>{_e(', '.join(b['written_by']) or 'copy-in')} &rarr; "
                    f"{_e(', '.join(b['read_by']))}</td></tr>")
    if not rows:
        return "<p class='muted'>No static buffers (no graph segment reads a live tensor).</p>"
    return ("<table><tr><th>name</th><th>role</th><th>shape at cap</th><th>dtype</th>"
            "<th class='num'>bytes</th><th>written by &rarr; read by</th></tr>" + "".join(rows) + "</table>")


def _segment_table(report: dict[str, Any]) -> str:
    rows = []
    for s in report["segments"]:
        r = s["break_reason"]
        why = "" if r is None else f"{r['kind']}: {r['op']}" + (f" ({r['detail']})" if r["detail"] else "")
        rows.append(f"<tr><td class='num'>{s['index']}</td><td>{_e(s['name'])}</td>"
                    f"<td><i style='display:inline-block;width:10px;height:10px;background:{_color(s)}'></i> "
                    f"{_e(s['kind'])}</td><td class='num'>{s['nodes']}</td>"
                    f"<td>{_e(', '.join(map(str, s['layer_ids'])))}</td><td>{_e(why)}</td></tr>")
    return ("<table><tr><th class='num'>#</th><th>segment</th><th>kind</th><th class='num'>nodes</th>"
            "<th>layers</th><th>break reason</th></tr>" + "".join(rows) + "</table>")


def _cards(report: dict[str, Any]) -> str:
    segs = report["segments"]
    graphs = sum(1 for s in segs if s["kind"] == "graph")
    mem, b, cap = report["memory"], report["buckets"], report["captures"]
    items = [
        (f"{len(segs)}", f"segments ({graphs} graph, {len(segs) - graphs} break)"),
        (f"{len(b['sizes'])}", f"buckets, cap {b['cap']}"),
        (f"{cap['count']}" if cap["captured"] else "-", "graphs captured"),
        (format_bytes(owned_buffer_bytes(report["static_buffers"])),
         f"{len(report['static_buffers'])} static buffers"),
        (format_bytes(mem["estimated_graph_bytes"]), "estimated graph memory"),
        (format_bytes(mem["measured_graph_bytes"]) if mem["measured_graph_bytes"] is not None else "n/a",
         "measured (CUDA pool growth)"),
        (f"{100 * b['summary']['token_weighted_waste']:.1f}%", "padding waste (token-weighted)"),
    ]
    traffic = report.get("traffic") or {}
    if traffic.get("forwards"):
        items.append((f"{100 * traffic['traffic_weighted_waste']:.1f}%",
                      f"padding waste on the {traffic['forwards']} forwards served"))
    return "<div class='cards'>" + "".join(
        f"<div class='card'><div class='v'>{_e(v)}</div><div class='k'>{_e(k)}</div></div>" for v, k in items
    ) + "</div>"


def render_html(report: dict[str, Any]) -> str:
    """The page for one stage report (a dict from :func:`ppcompile.debug.report.build_report`)."""
    cfg = report["config"]
    rank = "" if report["rank"] is None else f" · rank {report['rank']}"
    sub = (f"graph mode {report['graph_mode']} · segment compiler {cfg['segment_compiler']} · "
           f"ppcompile {report['versions']['ppcompile']} · torch {report['versions']['torch']}")
    banner = (f"<div class='banner'><b>Every forward of this stage runs eagerly:</b> "
              f"{_e(report['eager_reason'])}</div>") if report["eager_reason"] else ""
    passes = "".join(f"<tr><td>{_e(k)}</td><td class='num'>{v:.2f}</td></tr>"
                     for k, v in report["pass_times_ms"].items())
    # "<" escaped: no text from the report can close the script element
    data = json.dumps(report, separators=(",", ":"), default=str).replace("<", "\\u003c")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>ppcompile report: {_e(report['stage_graph'])}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_CSS}</style></head>
<body><header><h1>ppcompile stage report: {_e(report['stage_graph'])}{_e(rank)}</h1>
<div class="sub">{_e(sub)}</div></header><main>{banner}{_cards(report)}
<section><h2>Timeline of segments</h2>{_timeline(report)}</section>
<section><h2>Static buffers</h2>{_buffer_table(report)}</section>
<section><h2>Padding waste per token count</h2>{_padding_plot(report)}</section>
<section><h2>Capture time per bucket</h2>{_capture_plot(report)}</section>
<section><h2>Segments</h2>{_segment_table(report)}</section>
<section><h2>Pass times (ms)</h2><table>{passes}</table></section>
<p class="muted">Memory: {_e(report['memory']['note'])}.</p>
</main><script type="application/json" id="report-data">{data}</script><script>{_JS}</script></body></html>
"""

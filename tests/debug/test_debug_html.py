"""``report.html``: self-contained, draws every segment, and renders in a real headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from debug_helpers import compile_stage

from ppcompile.debug import build_report
from ppcompile.debug.html import GRAPH_COLOR, KIND_COLORS, render_html
from ppcompile.records import BREAK_KINDS, BreakKind

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    import torch

    torch._dynamo.reset()
    out = tmp_path_factory.mktemp("dumps")
    stage = compile_stage({"dump_dir": str(out)}, cfg_name="small-dense")  # 2 layers: 2 attention breaks
    stage.call(10)
    folder = out / stage.runtime.name
    report = build_report(stage.runtime)
    torch._dynamo.reset()
    return folder, report


def _embedded(page: str) -> dict[str, Any]:
    m = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.S)
    assert m is not None
    return json.loads(m.group(1))  # type: ignore[no-any-return]


def test_page_is_self_contained(report: tuple[Path, dict[str, Any]]) -> None:
    folder, data = report
    page = (folder / "report.html").read_text()
    assert "://" not in page  # no URL of any scheme: nothing to fetch
    assert "<link" not in page and not re.search(r"<(script|img|iframe)[^>]*\ssrc=", page)
    embedded = _embedded(page)
    assert embedded.pop("written")["after"] == "capture"  # publish_report stamps the files it writes
    assert embedded == json.loads(json.dumps(data))


def test_page_draws_every_segment_and_buffer(report: tuple[Path, dict[str, Any]]) -> None:
    folder, data = report
    page = (folder / "report.html").read_text()
    rects = re.findall(r"<rect class='seg' data-index='(\d+)' data-name='(\w+)'[^>]*fill='(#\w+)'", page)
    assert [(int(i), n) for i, n, _ in rects] == [(s["index"], s["name"]) for s in data["segments"]]
    want = [GRAPH_COLOR if s["kind"] == "graph" else KIND_COLORS["attention"] for s in data["segments"]]
    assert [c for _, _, c in rects] == want
    assert page.count("<tr data-segs=") == len(data["static_buffers"])
    assert "id='padplot'" in page and "id='captureplot'" in page
    assert page.count("L2</text>") == 1 and page.count("L3</text>") == 1  # layer ids over the breaks


def test_text_from_the_report_is_escaped() -> None:
    data = build_report_stub()
    data["segments"][0]["break_reason"]["detail"] = "</script><script>alert(1)</script>"
    page = render_html(data)
    assert "<script>alert(1)" not in page and page.count("</script>") == 2
    assert _embedded(page)["segments"][0]["break_reason"]["detail"].startswith("</script>")


@pytest.mark.parametrize("kind", list(BreakKind))
def test_a_break_is_drawn_in_its_kinds_colour(kind: BreakKind) -> None:
    """The timeline and the legend take a break's colour from its kind's row of ``BREAK_KINDS``."""
    data = build_report_stub()
    data["segments"][0]["break_reason"]["kind"] = kind.value
    page = render_html(data)
    color = BREAK_KINDS[kind].color
    assert re.findall(r"<rect class='seg'[^>]*fill='(#\w+)'", page) == [color]
    assert f"<i style='background:{color}'></i>" in page  # its legend entry


def build_report_stub() -> dict[str, Any]:
    """The smallest report render_html accepts: one break segment, no buffers, two buckets."""
    table = [[1, 2, 1.0], [2, 2, 0.0], [3, 4, 0.3333], [4, 4, 0.0]]
    return {
        "stage_graph": "g", "rank": None, "versions": {"ppcompile": "0", "torch": "0"},
        "graph_mode": "emulate", "eager_reason": None, "config": {"segment_compiler": "eager"},
        "segments": [{"index": 0, "name": "submod_0", "kind": "break", "nodes": 1, "layer_ids": [0],
                      "break_reason": {"kind": "attention", "op": "op", "detail": "", "stack_trace": None},
                      "reads_static": [], "writes_static": [], "output_bytes_at_cap": None,
                      "transient_bytes_at_cap": None}],
        "static_buffers": [],
        "buckets": {"sizes": [2, 4], "cap": 4, "max_padding_factor": 2.0, "table": table,
                    "per_bucket": [], "summary": {"token_weighted_waste": 0.1, "max_waste": 1.0,
                                                  "max_waste_at": 1, "eager_at_or_below_cap": 0}},
        "captures": {"count": 0, "runs": [], "captured": False},
        "memory": {"estimated_graph_bytes": None, "measured_graph_bytes": None, "note": "n"},
        "pass_times_ms": {},
    }


# ------------------------------------------------------------------------------ SVG geometry
_PX_PER_CHAR = 5.5  # at least this wide per character at the SVGs' 11 px font


def _svg_texts(page: str) -> list[tuple[str, float, float, str, str]]:
    """``(svg id, svg width, x, anchor, text)`` of every text element of every SVG on the page."""
    out = []
    svgs = re.findall(r"<svg id='(\w+)'[^>]*viewBox='0 0 ([\d.]+) [\d.]+'[^>]*>(.*?)</svg>", page, re.S)
    for svg_id, width, body in svgs:
        for attrs, text in re.findall(r"<text ([^>]*)>([^<]*)</text>", body):
            x = float(re.search(r"x='([-\d.]+)'", attrs).group(1))  # type: ignore[union-attr]
            anchor = re.search(r"text-anchor='(\w+)'", attrs)
            out.append((svg_id, float(width), x, anchor.group(1) if anchor else "start", text))
    return out


def _extent(x: float, anchor: str, text: str) -> tuple[float, float]:
    w = _PX_PER_CHAR * len(text)
    return {"start": (x, x + w), "middle": (x - w / 2, x + w / 2), "end": (x - w, x)}[anchor]


def test_every_svg_label_fits_its_svg() -> None:
    """A long capture time (its axis label) and a break at each end of the timeline with wide layer
    labels: every label lies inside its SVG, the last one anchored at the right edge."""
    data = build_report_stub()
    first = data["segments"][0]
    first["layer_ids"] = [120, 121]
    graph = {**first, "index": 1, "name": "submod_1", "kind": "graph", "nodes": 60, "layer_ids": [],
             "break_reason": None}
    last = {**first, "index": 2, "name": "submod_2", "layer_ids": [126, 127]}
    data["segments"] = [first, graph, last]
    buckets = [{"bucket": b, "graphs": 1, "seconds": s, "output_bytes": 0, "pool_bytes": None}
               for b, s in ((2, 0.5), (4, 12.345), (65536, 3.0))]
    data["captures"] = {"count": 3, "captured": True, "runs": [
        {"graphs": 3, "graph_mode": "cuda", "seconds": 15.8, "output_bytes": 0, "measured_bytes": None,
         "failed": None, "buckets": buckets}]}
    texts = _svg_texts(render_html(data))
    assert {t[0] for t in texts} == {"timeline", "padplot", "captureplot"}
    for svg_id, width, x, anchor, text in texts:
        lo, hi = _extent(x, anchor, text)
        assert lo >= 0 and hi <= width, f"{svg_id}: {text!r} at x={x} ({anchor}) spans {lo:.0f}..{hi:.0f}"
    labels = {text: (x, anchor) for svg_id, _, x, anchor, text in texts if svg_id == "timeline"}
    assert labels["L126,127"][1] == "end" and labels["L120,121"][1] == "start"
    assert "12345 ms" in {text for svg_id, *_, text in texts if svg_id == "captureplot"}


# ------------------------------------------------------------------------------ a real browser
def _browser() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no Chromium found (tried " + ", ".join(BROWSERS) + "): the report.html browser test "
                "needs one; on Debian: apt-get install -y chromium")


def _chromium(browser: str, profile: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
           f"--user-data-dir={profile}", *args]
    return subprocess.run(cmd, capture_output=True, timeout=120, check=False)


def _png_pixels(data: bytes) -> tuple[int, int, list[tuple[int, int, int]]]:
    """Width, height and RGB pixels of an 8-bit, non-interlaced RGB or RGBA PNG (what Chromium writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert header is not None
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, f"unsupported PNG {header}"
    bpp = 3 if color == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    prev = bytearray(stride)
    pixels = []
    for y in range(height):
        ftype, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if ftype == 1:
                line[i] = (line[i] + a) & 255
            elif ftype == 2:
                line[i] = (line[i] + b) & 255
            elif ftype == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        pixels += [tuple(line[i:i + 3]) for i in range(0, stride, bpp)]  # type: ignore[misc]
        prev = line
    return width, height, pixels


def _rgb(hex_color: str) -> tuple[int, int, int]:
    return int(hex_color[1:3], 16), int(hex_color[3:5], 16), int(hex_color[5:7], 16)


def test_page_renders_in_headless_chromium(report: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    browser = _browser()
    folder, _ = report
    url = (folder / "report.html").as_uri()
    shot = tmp_path / "report.png"
    done = _chromium(browser, tmp_path / "profile", "--window-size=1280,1400", f"--screenshot={shot}", url)
    assert shot.is_file(), f"no screenshot: {done.stderr.decode(errors='replace')[-2000:]}"
    png = shot.read_bytes()
    assert len(png) > 30_000  # a page of charts and tables, not a blank one
    width, height, pixels = _png_pixels(png)
    assert (width, height) == (1280, 1400)
    counts = Counter(pixels)
    assert counts[_rgb(GRAPH_COLOR)] > 20_000  # graph segments, the padding curve, capture bars
    assert counts[_rgb(KIND_COLORS["attention"])] > 500  # the two attention breaks
    assert len(counts) > 50  # text, anti-aliasing: a drawn page has many colours

    dom = _chromium(browser, tmp_path / "profile2", "--dump-dom", url + "#segment=1")
    text = dom.stdout.decode(errors="replace")
    assert 'data-ready="1"' in text, "the page's script did not run to its end"
    details = re.search(r'<div id="details"[^>]*>(.*?)</div></section>', text, re.S)
    assert details is not None and "attention" in details.group(1) and "layers.py" in details.group(1)

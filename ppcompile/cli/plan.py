"""``python -m ppcompile plan --traffic FILE --max-buckets K``: a bucket ladder planned from recorded
traffic. ``--probe`` measures ``graph_gain_tokens`` on this device first (``ppcompile.cli.gain_probe``) and
plans with it (or only prints it, without ``--traffic``).

FILE is a token histogram in JSON (``TokenHistogram.save``, e.g. of ``ppcompile.token_histogram()``
merged over ranks). Prints the planned ladder next to the default ladder up to the same cap (cost,
padded tokens per served token, fraction of forwards graphed) and the ``torch.compile`` options that
apply it. The cost model is ``ppcompile.planning.planner``'s: padding minus ``--graph-gain-tokens`` per
graphed forward, eager forwards free.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping

import torch

from ppcompile.cli.args import int_list
from ppcompile.cli.gain_probe import GainProbe, probe_graph_gain
from ppcompile.config import DEFAULT_MAX_CAPTURE_TOKENS
from ppcompile.debug.table import format_table
from ppcompile.planning.planner import DEFAULT_GRAPH_GAIN_TOKENS, LadderPlan, evaluate_ladder, plan_buckets
from ppcompile.planning.traffic import TokenHistogram
from ppcompile.runtime.buckets import default_capture_ladder

__all__ = ["add_arguments", "compare", "format_comparison", "format_probe", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The plan command's options."""
    parser.add_argument("--traffic", metavar="FILE",
                        help="token histogram JSON (TokenHistogram.save / ppcompile.token_histogram())")
    parser.add_argument("--max-buckets", type=int, default=16, help="most buckets to capture (default 16)")
    parser.add_argument("--cap", type=int, default=None,
                        help=f"largest bucket (default {DEFAULT_MAX_CAPTURE_TOKENS}, the runtime's cap)")
    parser.add_argument("--max-padding-factor", type=float, default=2.0,
                        help="the runtime's padding guard (default 2.0)")
    parser.add_argument("--graph-gain-tokens", type=float, default=DEFAULT_GRAPH_GAIN_TOKENS,
                        help="tokens of compute one replay saves over eager (default "
                             f"{DEFAULT_GRAPH_GAIN_TOKENS}: the seed's figures, docs/benchmarks.md)")
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")
    parser.add_argument("--probe", action="store_true",
                        help="measure graph_gain_tokens on this device (eager vs graphed forwards of a "
                             "reference stage) and plan with it")
    parser.add_argument("--probe-sizes", type=int_list, default=[16, 32, 64, 128],
                        help="comma-separated token counts the probe times (default 16,32,64,128)")
    parser.add_argument("--probe-model", default="tiny", help="reference model of the probe stage")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device of the probe (default: cuda when available)")


def run(args: argparse.Namespace) -> int:
    """Plans and prints; exits 2 on a missing or malformed traffic file or a bad option."""
    if args.traffic is None and not args.probe:
        return _fail("give --traffic FILE (a token histogram to plan from), --probe, or both")
    if args.probe:
        try:
            probe = probe_graph_gain(args.probe_sizes, model=args.probe_model, device=args.device)
        except ValueError as e:
            return _fail(f"--probe: {e}")
        print(format_probe(probe))
        args.graph_gain_tokens = max(0.0, probe.graph_gain_tokens)  # below 0: graphs do not pay here
        if probe.graph_gain_tokens < 0:
            print("the probe measured graphs slower than eager; planning with graph_gain_tokens = 0")
        if args.traffic is None:
            return 0
        print()
    try:
        histogram = TokenHistogram.load(args.traffic)
    except OSError as e:
        return _fail(f"cannot read --traffic {args.traffic!r}: {e.strerror or e}")
    except ValueError as e:
        return _fail(f"--traffic: {e}")
    try:
        plans = compare(histogram, args.max_buckets, cap=args.cap,
                        max_padding_factor=args.max_padding_factor, graph_gain_tokens=args.graph_gain_tokens)
    except ValueError as e:
        return _fail(str(e))
    if args.json:
        print(json.dumps({name: _as_dict(plan) for name, plan in plans.items()}, indent=1))
    else:
        print(format_comparison(histogram, plans, source=args.traffic))
    return 0


def compare(
    histogram: TokenHistogram,
    max_buckets: int,
    *,
    cap: int | None = None,
    max_padding_factor: float = 2.0,
    graph_gain_tokens: float = DEFAULT_GRAPH_GAIN_TOKENS,
) -> dict[str, LadderPlan]:
    """The planned ladder and the default ladder up to the same cap, scored alike (``planned``,
    ``default``)."""
    planned = plan_buckets(histogram, max_buckets, cap=cap, max_padding_factor=max_padding_factor,
                           graph_gain_tokens=graph_gain_tokens)
    default = evaluate_ladder(histogram, default_capture_ladder(cap or DEFAULT_MAX_CAPTURE_TOKENS),
                              max_padding_factor=max_padding_factor, graph_gain_tokens=graph_gain_tokens)
    return {"planned": planned, "default": default}


def format_comparison(histogram: TokenHistogram, plans: Mapping[str, LadderPlan], source: str = "") -> str:
    """The ladders side by side, each one's sizes, and the options of the planned one."""
    counts = histogram.counts()
    first = next(iter(plans.values()))
    lines = [
        f"traffic {source}: {histogram.total} forwards, {len(counts)} distinct token counts, "
        f"{histogram.total_tokens} tokens",
        f"cost model: padding minus {first.graph_gain_tokens:g} tokens per graphed forward; "
        f"max_padding_factor {first.max_padding_factor:g}",
        "",
    ]
    rows = [(name, len(p.capture_sizes), p.capture_sizes[-1] if p.capture_sizes else "-", f"{p.cost:.4g}",
             f"{p.padding_per_served_token:.4f}", f"{100 * p.graphed_fraction:.2f}%")
            for name, p in plans.items()]
    headers = ["ladder", "buckets", "largest", "cost", "padded/served token", "graphed forwards"]
    lines.append(format_table(headers, rows, right=(1, 2, 3, 4, 5)))
    lines.append("")
    lines += [f"{name}: {_sizes(p.capture_sizes)}" for name, p in plans.items()]
    if "planned" in plans:
        lines += ["", "torch.compile options: " + json.dumps(plans["planned"].options())]
    return "\n".join(lines)


def format_probe(probe: GainProbe) -> str:
    """The probe's timings per size and the gain they imply."""
    rows = [(n, f"{1e3 * e:.3f}", f"{1e3 * g:.3f}", f"{gain:.0f}")
            for n, e, g, gain in zip(probe.sizes, probe.eager_s, probe.graph_s, probe.gain_tokens)]
    table = format_table(["tokens", "eager ms", "graphed ms", "gain (tokens)"], rows, right=(0, 1, 2, 3))
    note = ("" if probe.graph_mode == "cuda" else
            f"\n(graph mode {probe.graph_mode}: no real graphs here, so the gain is not the one a GPU gives)")
    return (f"probe on {probe.device}, graph mode {probe.graph_mode}: {1e6 * probe.seconds_per_token:.3f} us "
            f"per token (graphed)\n{table}\ngraph_gain_tokens = {probe.graph_gain_tokens:.0f}{note}")


def _sizes(sizes: tuple[int, ...]) -> str:
    if not sizes:
        return "(none: every forward eager)"
    shown = [str(s) for s in sizes] if len(sizes) <= 24 else [*map(str, sizes[:12]), "...",
                                                                 *map(str, sizes[-6:])]
    return ", ".join(shown)


def _as_dict(plan: LadderPlan) -> dict[str, object]:
    return {
        "capture_sizes": list(plan.capture_sizes),
        "cost": plan.cost,
        "padded_tokens": plan.padded_tokens,
        "served_tokens": plan.served_tokens,
        "padding_per_served_token": plan.padding_per_served_token,
        "graphed_forwards": plan.graphed_forwards,
        "total_forwards": plan.total_forwards,
        "graphed_fraction": plan.graphed_fraction,
        "options": plan.options(),
    }


def _fail(message: str) -> int:
    print(f"ppcompile plan: {message}", file=sys.stderr)
    return 2

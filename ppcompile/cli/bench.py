"""``python -m ppcompile bench``: the prefill benchmarks of a source checkout, and their write-up.

Runs ``bench/prefill_throughput.py``, ``bench/stage_profile.py`` and ``bench/overhead.py`` in one
process on one stage (``--quick``: the CPU suite, under a minute), prints their tables and saves their
JSON (and the throughput plot) under ``--out``. Only when asked (``--write-docs``, or ``--docs-file
FILE``) does it write their sections of the tracked ``docs/benchmarks.md`` (or FILE), with the plot under
``benchmarks/`` beside it, like ``bench/*.py --write``. ``--render DIR`` writes the docs from results
saved earlier (e.g. the folder that ``bench/gpu_check.sh`` filled on a GPU machine) without running
anything.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["add_arguments", "render_docs", "run"]

REPO_ROOT = Path(__file__).resolve().parents[2]  # ppcompile/cli/bench.py -> the checkout
BENCHES = ("throughput", "profile", "overhead")
DOCS = REPO_ROOT / "docs" / "benchmarks.md"


def _bench(name: str) -> ModuleType:
    """Imports ``bench.<name>`` from the source checkout this package lives in."""
    if not (REPO_ROOT / "bench" / f"{name}.py").exists():
        raise SystemExit(
            f"ppcompile bench: {REPO_ROOT / 'bench' / (name + '.py')} not found; the benchmarks run from "
            "a source checkout (pip install -e .), not from an installed wheel"
        )
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    return importlib.import_module(f"bench.{name}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench command's options (the suite options come from ``bench/common.py``)."""
    parser.add_argument("--quick", action="store_true",
                        help="the quick CPU suite (under a minute): same as --suite cpu-quick --device cpu")
    parser.add_argument("--only", default=",".join(BENCHES),
                        help=f"comma-separated subset of {','.join(BENCHES)}")
    parser.add_argument("--out", type=Path, default=None,
                        help="results folder (default: bench/results/<cpu|gpu>)")
    parser.add_argument("--write-docs", "--write", dest="docs", action="store_true", default=None,
                        help="also write the results into docs/benchmarks.md and docs/benchmarks/ (tracked "
                             "files; default: only print them and save them under --out)")
    parser.add_argument("--no-docs", dest="docs", action="store_false",
                        help="do not write the docs, even with --docs-file (the default without it)")
    parser.add_argument("--render", type=Path, default=None, metavar="DIR",
                        help="run nothing: write the docs from the results saved in DIR")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="time box: throughput starts no new repeat after 60%% of it")
    parser.add_argument("--docs-file", type=Path, default=None,
                        help="markdown file to write, implies --write-docs (default docs/benchmarks.md; "
                             "plots go to benchmarks/ next to it)")
    if (REPO_ROOT / "bench" / "common.py").exists():
        _bench("common").add_suite_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Runs the chosen benchmarks (or renders saved ones); returns the exit code."""
    write_docs = args.docs if args.docs is not None else args.docs_file is not None
    args.docs_file = args.docs_file or DOCS
    if args.render is not None:
        written = render_docs(args.render, args.docs_file)
        print(f"wrote {args.docs_file} ({', '.join(written) or 'nothing: no results found'})")
        return 0 if written else 1
    only = [b.strip() for b in args.only.split(",") if b.strip()]
    unknown = sorted(set(only) - set(BENCHES))
    if unknown:
        raise SystemExit(f"ppcompile bench --only: unknown {unknown}; valid: {list(BENCHES)}")
    common, report = _bench("common"), _bench("report")
    if args.quick:
        args.suite, args.device = "cpu-quick", "cpu"
    suite = common.suite_from_args(args)
    common.apply_threads(suite)
    kind = "gpu" if suite.stage.device == "cuda" else "cpu"
    out: Path = args.out or REPO_ROOT / "bench" / "results" / kind
    out.mkdir(parents=True, exist_ok=True)
    report.save_json(out / "machine.json", report.machine_info(suite.stage.device, suite.threads))
    print(f"ppcompile bench: suite {args.suite or 'default'} on {suite.stage.device}; "
          f"{suite.stage.describe()}; results in {out}", flush=True)
    harness = common.make_harness(suite) if {"throughput", "profile"} & set(only) else None
    if "throughput" in only:
        tp = _bench("prefill_throughput")
        deadline = time.monotonic() + 0.6 * args.budget_s if args.budget_s else None
        result = tp.run_throughput(harness, suite, seed=args.seed, deadline=deadline,
                                   on_repeat=lambda r: report.save_json(out / "throughput.json", r))
        print("\n## Prefill throughput\n\n" + tp.markdown(result), flush=True)
        tp.plot(result, out / "prefill_throughput.png")
    if "profile" in only:
        sp = _bench("stage_profile")
        result = sp.run_profile(harness, suite, seed=args.seed)
        report.save_json(out / "profile.json", result)
        print("\n## Stage wall vs busy\n\n" + sp.markdown(result), flush=True)
    if "overhead" in only:
        ov = _bench("overhead")
        del harness  # its compiled modules go with Dynamo's reset in run_overhead
        result = ov.run_overhead(suite.stage.device, suite.overhead_iters, layers=suite.overhead_layers)
        report.save_json(out / "overhead.json", result)
        print("\n## Runtime overhead\n\n" + ov.markdown(result), flush=True)
    if write_docs:
        written = render_docs(out, args.docs_file)
        print(f"\nwrote {args.docs_file} ({', '.join(written)})")
    else:
        print(f"\n{args.docs_file} not changed: add --write-docs to write these results into it")
    return 0


def render_docs(results: Path, docs: Path = DOCS) -> list[str]:
    """Writes the benchmark sections of ``docs`` (plots under ``benchmarks/`` next to it) from the JSON
    files in ``results``; returns which results it wrote. CPU and GPU figures have sections of their
    own, so writing one never erases the other; other sections of the file are kept."""
    report = _bench("report")
    plots = docs.parent / "benchmarks"
    loaded: dict[str, Any] = {}
    for name in BENCHES:
        path = results / f"{name}.json"
        if path.exists():
            loaded[name] = report.load_json(path)
    if not loaded:
        return []
    device = next(iter(loaded.values()))["machine"]["device"]
    kind = "gpu" if device == "cuda" else "cpu"
    parts = [f"## Prefill benchmarks: {'GPU' if kind == 'gpu' else 'CPU'}", ""]
    machine = next(iter(loaded.values()))["machine"]
    parts += [f"Measured {machine['date']} by `{_command(kind)}`.", ""]
    if kind == "cpu":
        parts += [_bench("prefill_throughput").CPU_NOTE, ""]
    if "throughput" in loaded:
        tp = _bench("prefill_throughput")
        plot_name = f"prefill_throughput_{kind}.png"
        parts += ["### Throughput, eager vs graph", "", tp.markdown(loaded["throughput"]), ""]
        if tp.plot(loaded["throughput"], plots / plot_name):
            parts += [f"![prefill throughput ({kind})](benchmarks/{plot_name})", ""]
        elif (results / "prefill_throughput.png").exists():
            plots.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(results / "prefill_throughput.png", plots / plot_name)
            parts += [f"![prefill throughput ({kind})](benchmarks/{plot_name})", ""]
    if "profile" in loaded:
        sp = _bench("stage_profile")
        parts += ["### Stage wall time vs busy time", "", sp.markdown(loaded["profile"]), ""]
    if "overhead" in loaded:
        parts += ["### Runtime host overhead", "", _bench("overhead").markdown(loaded["overhead"]), ""]
    report.update_markdown_section(docs, "prefill", _METHOD)
    report.update_markdown_section(docs, f"prefill-{kind}", "\n".join(parts))
    other = "gpu" if kind == "cpu" else "cpu"
    if not report.has_markdown_section(docs, f"prefill-{other}"):
        report.update_markdown_section(docs, f"prefill-{other}", _placeholder(other))
    return sorted(loaded)


_METHOD = """\
## Prefill benchmarks: what is measured

The seed engine change (`reference/seed-pr-36248.md`) measured, on one PP stage of a large MoE model,
prefill-only throughput at aggregate caps 2K..32K (graphs 2.48x eager at 2K, 1.93x at 4K, 1.12x at 8K,
0.98x and 0.97x above) and stage wall time cut 71-73% with kernel busy time unchanged. The same kinds of
measurement for `pp_breakable`, on a reference-model stage (`ppcompile.models`):

- **Throughput** (`bench/prefill_throughput.py`): a stream of varlen prefill forwards per cap (a chunked-
  prefill scheduler in miniature: half the forwards fill the cap, the rest take between half and all of
  it), eager vs each `pp_breakable` variant (vs torch's `mode="reduce-overhead"` with Inductor graph
  partition at the attention op on a GPU), interleaved forward by forward in one process; tokens/s
  from each forward's median time over the repeats. `pp_breakable` captures its default ladder up to
  8192 tokens (scaled with the caps) and runs larger forwards eagerly, as the seed does; each path's
  first call (compile and capture) is timed, with the capture's seconds, graphs and (CUDA) pool growth.
  On CPU the caps are divided by a scale.
- **Wall vs busy** (`bench/stage_profile.py`): per forward, wall time against busy time from
  `torch.profiler` (GPU: kernel intervals; CPU: outermost ATen compute ops and Inductor kernels).
- **Host overhead** (`bench/overhead.py`): ppcompile's runtime cost per forward and per segment on a
  tiny, deep stage where compute is negligible, against eager's cost per ATen op. Target: at most 10 µs
  per segment. With segment bodies as no-ops (ppcompile's own host time), interleaved and back to back:
  at most 2 µs per graph segment.

GPU targets: at the 2K cap, graphs at least 2.5x eager tokens/s on a small-model stage; wall/busy at most
1.10 with graphs. `python -m ppcompile bench --quick --write-docs` reruns the CPU figures below (under a
minute; without `--write-docs` it only prints them);
`bash bench/gpu_check.sh` the GPU ones (then `python -m ppcompile bench --render <its folder>`).
Benchmarks are never timing asserts in the test suite.
"""


def _command(kind: str) -> str:
    return "python -m ppcompile bench --quick --write-docs" if kind == "cpu" else "bash bench/gpu_check.sh"


def _placeholder(kind: str) -> str:
    if kind == "gpu":
        return ("## Prefill benchmarks: GPU\n\nNot measured yet. On a machine with a CUDA GPU run "
                "`bash bench/gpu_check.sh` (results go to `$OUT` or `bench/results/gpu`), then "
                "`python -m ppcompile bench --render <that folder>` to write this section.")
    return ("## Prefill benchmarks: CPU\n\nNot measured yet: run "
            "`python -m ppcompile bench --quick --write-docs`.")

"""``python -m ppcompile dump --stage R/P --out DIR``: compile one stage of a reference model and dump it.

Builds stage ``R`` (0-based rank) of a ``P``-stage split of a reference model, compiles it with
``pp_breakable`` and ``dump_dir=DIR``, and runs one forward of ``--tokens`` tokens so the graphs are
captured. DIR then holds the pass dumps, the split module, each segment's code, ``report.json`` and
``report.html`` (see ``docs/debugging.md``); the report is printed as tables, then which of the ``.py``
files ``python FILE`` runs as is (the reference models' attention runs in a made-up forward context) and
why any other does not (its second line says so; run, it prints that and exits 0).
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import sys
import time

import torch

from ppcompile.cli.args import int_list
from ppcompile.debug.report import build_report
from ppcompile.debug.table import format_report
from ppcompile.observe.dumps import stage_dir

__all__ = ["add_arguments", "parse_stage", "run", "runnable_summary"]

_MAX_SEQ_LEN = 256  # the forward's tokens are split into sequences of at most this many


def parse_stage(text: str) -> tuple[int, int]:
    """``"1/4"`` -> ``(1, 4)``: rank (0-based) and number of stages."""
    try:
        rank_s, size_s = text.split("/")
        rank, size = int(rank_s), int(size_s)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--stage: expected R/P (0-based rank / stages), got {text!r}") from None
    if size < 1 or not 0 <= rank < size:
        raise argparse.ArgumentTypeError(f"--stage: rank must be in [0, {size}) and P >= 1, got {text!r}")
    return rank, size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The dump command's options."""
    from ppcompile.config import GRAPH_MODES, SEGMENT_COMPILERS
    from ppcompile.models import REFERENCE_CONFIGS

    parser.add_argument("--stage", type=parse_stage, required=True,
                        help="R/P: stage R (0-based) of a P-stage split, e.g. 1/4")
    parser.add_argument("--model", default="small-dense", choices=sorted(REFERENCE_CONFIGS),
                        help="reference model config (default: small-dense)")
    parser.add_argument("--out", required=True, help="dump folder (created; this stage's files are replaced)")
    parser.add_argument("--tokens", type=int, default=None,
                        help="token count of the forward that triggers capture (default: 100, or one less "
                             "than the largest capture size when that is smaller, so the forward takes the "
                             "graph path; avoid sizes equal to a model dim, which Dynamo may specialise)")
    parser.add_argument("--capture-sizes", type=int_list, default=None,
                        help="explicit buckets, comma-separated (default: the backend's ladder)")
    parser.add_argument("--max-capture-tokens", type=int, default=None,
                        help="cap of the default ladder (default: the backend's, 8192)")
    parser.add_argument("--graph-mode", choices=GRAPH_MODES, default=None,
                        help="graph_mode option (default: cuda on a CUDA device, else emulate: the dump "
                             "shows the graph path, which 'auto' does not take on CPU)")
    parser.add_argument("--segment-compiler", choices=SEGMENT_COMPILERS, default="eager",
                        help="segment_compiler option (default: eager)")
    parser.add_argument("--debug", action="store_true", help="debug option (replay address checks)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device of the stage (default: cuda when available)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1)")


_DEFAULT_TOKENS = 100


def default_tokens(capture_sizes: list[int] | None, max_capture_tokens: int | None) -> int:
    """The forward's token count when ``--tokens`` is not given: 100, or one less than the largest
    capture size (at least 2) when 100 would be above it and run eagerly."""
    from ppcompile.config import DEFAULT_MAX_CAPTURE_TOKENS

    top = max(capture_sizes) if capture_sizes else (max_capture_tokens or DEFAULT_MAX_CAPTURE_TOKENS)
    return _DEFAULT_TOKENS if top >= _DEFAULT_TOKENS else max(2, top - 1)


def run(args: argparse.Namespace) -> int:
    """Compiles, runs and dumps the stage; prints the report; returns the exit code."""
    from ppcompile.backends.pp_breakable import stage_runtimes
    from ppcompile.config import graph_path_mode
    from ppcompile.models import REFERENCE_CONFIGS, make_batch
    from ppcompile.pipeline import InProcessPipeline

    rank, size = args.stage
    cfg = REFERENCE_CONFIGS[args.model]
    if cfg.num_layers < size:
        print(f"ppcompile dump: model {args.model!r} has {cfg.num_layers} layers, cannot split over {size} "
              "stages", file=sys.stderr)
        return 2
    if args.tokens is None:
        args.tokens = default_tokens(args.capture_sizes, args.max_capture_tokens)
    if args.tokens < 2:
        print("ppcompile dump: --tokens must be >= 2 (Dynamo specialises 1-token forwards, which never "
              "take the graph path)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    # An application entry point: show ppcompile's log lines (PPCOMPILE_LOG_LEVEL=INFO for progress lines).
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    graph_mode = args.graph_mode or graph_path_mode(torch.device(args.device).type)
    options: dict[str, object] = {"dump_dir": os.path.abspath(args.out), "graph_mode": graph_mode,
                                  "segment_compiler": args.segment_compiler, "debug": args.debug}
    if args.capture_sizes:
        options["capture_sizes"] = args.capture_sizes
    elif args.max_capture_tokens is not None:
        options["max_capture_tokens"] = args.max_capture_tokens
    seq_lens = [min(_MAX_SEQ_LEN, args.tokens - i) for i in range(0, args.tokens, _MAX_SEQ_LEN)]
    before = {id(rt) for rt in stage_runtimes()}
    pipe = InProcessPipeline(cfg, size, compiled=True, options=options, device=args.device)
    ids, pos, proxies = make_batch(cfg, seq_lens, rank, size, seed=0, device=args.device)
    start = time.perf_counter()
    with torch.inference_mode():
        pipe.run_stage(rank, pos, seq_lens, input_ids=ids, pp_proxy_tensors=proxies)
    seconds = time.perf_counter() - start
    runtimes = [rt for rt in stage_runtimes() if id(rt) not in before]
    if not runtimes:
        print("ppcompile dump: the stage compiled to no pp_breakable graph", file=sys.stderr)
        return 1
    trace = pipe.traces[rank]
    print(f"ppcompile dump: {args.model} stage {rank}/{size}, {args.tokens} tokens in {len(seq_lens)} "
          f"sequence(s): compile + capture + forward in {seconds:.2f} s, path "
          f"{trace.path if trace else '?'}, bucket {trace.bucket if trace else '-'}")
    for rt in runtimes:
        folder = stage_dir(str(options["dump_dir"]), rt.name)
        if trace is not None and trace.path != "graph":
            why = rt.eager_reason or rt.plan.eager_reason(args.tokens) or "see the report"
            print(f"note: the forward ran eagerly ({why}); nothing was captured")
        print(format_report(build_report(rt), folder))
        print(f"\nfiles: {folder}{os.sep} (open report.html in a browser)")
        print(runnable_summary(folder))
    return 0


def runnable_summary(folder: str) -> str:
    """Which ``.py`` files under ``folder`` run as is (``python FILE``), and why the others do not."""
    from ppcompile.observe.runnable import not_runnable_reason

    files = sorted(glob.glob(os.path.join(glob.escape(folder), "**", "*.py"), recursive=True))
    others = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            why = not_runnable_reason(f.read())
        if why is not None:
            others.append(f"  {os.path.relpath(path, folder)}: {why}")
    if not others:
        return (f"all {len(files)} .py files run as is: python FILE runs the graph once on random inputs "
                "(in a made-up forward context where it calls the reference attention)")
    return (f"{len(files) - len(others)} of {len(files)} .py files run as is; the others print why and "
            "exit 0:\n" + "\n".join(others))

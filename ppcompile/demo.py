"""``python -m ppcompile demo``: a PP pipeline of a reference model, eager and ``pp_breakable`` side by side.

Runs a stream of varlen batches whose total token counts go from 1 token to above the capture cap through
two :class:`~ppcompile.pipeline.InProcessPipeline` instances with the same weights, and prints one row per
forward: the path each stage took (graph or eager), the bucket, the largest logits difference and both
wall times. Exits non-zero when a difference exceeds the tolerance.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Sequence

import torch

from ppcompile.backends.pp_breakable import stage_runtimes
from ppcompile.config import PPBreakableConfig
from ppcompile.counters import counters
from ppcompile.models import REFERENCE_CONFIGS, make_batch
from ppcompile.pipeline import InProcessPipeline
from ppcompile.runtime.buckets import BucketPlan, make_bucket_plan

__all__ = ["add_arguments", "default_token_stream", "parse_tokens", "run", "run_demo"]

_MAX_SEQ_LEN = 256  # long batches are split into sequences of at most this many tokens (attention is O(n^2))
_ATOL = {torch.float32: 1e-4, torch.float64: 1e-8, torch.float16: 5e-2, torch.bfloat16: 1e-1}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's command-line options."""
    parser.add_argument("--config", default="small-moe", choices=sorted(REFERENCE_CONFIGS),
                        help="reference model config (default: small-moe)")
    parser.add_argument("--pp", type=int, default=4, help="pipeline-parallel stages (default: 4)")
    parser.add_argument("--max-capture-tokens", type=int, default=None,
                        help="cap of the default bucket ladder (default: the backend's, 8192)")
    parser.add_argument("--capture-sizes", type=_int_list, default=None,
                        help="explicit buckets, comma-separated (overrides --max-capture-tokens)")
    parser.add_argument("--tokens", type=parse_tokens, default=None,
                        help="batches, comma-separated: a total count (split into sequences) or "
                             "'+'-joined sequence lengths, e.g. 1,17,8+9+20 (default: 1 to above the cap)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random varlen mixes and inputs")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: the reference models are tiny)")
    parser.add_argument("--atol", type=float, default=None,
                        help="tolerance on logits (default: 1e-4 for float32)")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def parse_tokens(text: str) -> list[list[int] | int]:
    """``"1,17,8+9"`` -> ``[1, 17, [8, 9]]``: totals, or explicit sequence lengths joined by ``+``."""
    items: list[list[int] | int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            lens = [int(x) for x in part.split("+")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"--tokens: bad entry {part!r}; expected N or A+B+C") from None
        if any(n < 1 for n in lens):
            raise argparse.ArgumentTypeError(f"--tokens: counts must be >= 1, got {part!r}")
        items.append(lens if "+" in part else lens[0])
    return items


def split_tokens(total: int, num_seqs: int, rng: random.Random) -> list[int]:
    """``total`` tokens as ``num_seqs`` random positive sequence lengths."""
    num_seqs = max(1, min(num_seqs, total))
    cuts = sorted(rng.sample(range(1, total), num_seqs - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


def _as_seq_lens(item: list[int] | int, rng: random.Random) -> list[int]:
    if isinstance(item, list):
        return item
    return split_tokens(item, math.ceil(item / _MAX_SEQ_LEN), rng)


def default_token_stream(plan: BucketPlan, rng: random.Random, mixes: int = 3) -> list[list[int] | int]:
    """1 token, a small count, exactly a bucket, bucket + 1, random varlen mixes, cap - 1, cap, above."""
    cap = plan.cap
    bucket = next((s for s in plan.sizes if s >= 16), plan.sizes[-1])
    stream: list[list[int] | int] = [1, min(5, cap), bucket, bucket + 1]
    for _ in range(mixes):
        total = rng.randint(8, max(8, min(cap, 4 * _MAX_SEQ_LEN)))
        stream.append(split_tokens(total, rng.randint(2, 6), rng))
    stream += [cap - 1, cap, cap + 7]
    return [x for x in stream if isinstance(x, list) or x >= 1]


def _paths(pipe: InProcessPipeline) -> tuple[str, str]:
    paths = [t.path if t else "?" for t in pipe.traces]
    buckets = sorted({t.bucket for t in pipe.traces if t and t.bucket is not None})
    path = f"{paths[0]} x{len(paths)}" if len(set(paths)) == 1 else "/".join(paths)
    return path, ",".join(map(str, buckets)) or "-"


def run_demo(args: argparse.Namespace) -> int:
    """Runs the demo; returns the process exit code (1 when a difference exceeds the tolerance)."""
    cfg = REFERENCE_CONFIGS[args.config]
    torch.set_num_threads(args.threads)
    options: dict[str, object] = {}
    if args.capture_sizes:
        options["capture_sizes"] = args.capture_sizes
    elif args.max_capture_tokens is not None:
        options["max_capture_tokens"] = args.max_capture_tokens
    plan = make_bucket_plan(PPBreakableConfig.from_options(options))
    rng = random.Random(args.seed)
    stream = args.tokens if args.tokens is not None else default_token_stream(plan, rng)
    atol = args.atol if args.atol is not None else _ATOL.get(cfg.dtype, 1e-4)

    eager = InProcessPipeline(cfg, args.pp, compiled=False)
    graphed = InProcessPipeline(cfg, args.pp, compiled=True, options=options)
    t0 = time.perf_counter()
    warm = min(16, plan.cap)
    ids, pos, _ = make_batch(cfg, [warm], 0, args.pp, seed=args.seed)
    with torch.inference_mode():
        graphed(ids, pos, [warm])
    warm_s = time.perf_counter() - t0

    print(f"ppcompile demo: config {args.config} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.dtype}), PP{args.pp} in one process, "
          f"{args.threads} thread(s), options {options or '{}'}")
    print(f"buckets: {len(plan.sizes)} up to cap {plan.cap}, max_padding_factor {plan.max_padding_factor:g}; "
          f"compile + capture of every bucket in {warm_s:.1f} s (warm-up forward of {warm} tokens)")
    if not any(rt.graph_mode == "cuda" for rt in stage_runtimes()):
        print("note: no GPU, graphs are emulated on CPU: pp_breakable times show overhead, not a speed-up")
    for rt in stage_runtimes():
        if not rt.eager_reason:
            print(rt.describe())
    header = (f"{'#':>3} {'tokens':>7} {'seqs':>4}  {'path (per stage)':<26} {'bucket':>6} "
              f"{'max|diff|':>10} {'eager ms':>9} {'pp_brk ms':>9}  note")
    print(header)
    print("-" * len(header))
    failures = 0
    for i, item in enumerate(stream):
        lens = _as_seq_lens(item, rng)
        ids, pos, _ = make_batch(cfg, lens, 0, args.pp, seed=args.seed + i)
        with torch.inference_mode():
            t = time.perf_counter()
            want = eager(ids, pos, lens)
            eager_ms = 1e3 * (time.perf_counter() - t)
            compiles = counters.backend_compiles
            t = time.perf_counter()
            got = graphed(ids, pos, lens)
            graph_ms = 1e3 * (time.perf_counter() - t)
        diff = (want.float() - got.float()).abs().max().item()
        path, bucket = _paths(graphed)
        notes = []
        if counters.backend_compiles != compiles:
            notes.append(f"+{counters.backend_compiles - compiles} Dynamo compile(s)")
        if diff > atol:
            notes.append(f"MISMATCH > {atol:g}")
            failures += 1
        print(f"{i:>3} {sum(lens):>7} {len(lens):>4}  {path:<26} {bucket:>6} {diff:>10.2e} "
              f"{eager_ms:>9.1f} {graph_ms:>9.1f}  {'; '.join(notes)}")
    c = counters
    print(f"counters: replays {c.replays}, eager_runs {c.eager_runs}, captures {c.captures}, "
          f"backend_compiles {c.backend_compiles}")
    verdict = "FAIL" if failures else "OK"
    print(f"{verdict}: {failures} of {len(stream)} forwards differ by more than {atol:g}")
    return 1 if failures else 0


run = run_demo  # the CLI's entry point for this command


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for ``python -m ppcompile.demo``."""
    parser = argparse.ArgumentParser(prog="ppcompile demo", description=__doc__)
    add_arguments(parser)
    return run_demo(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

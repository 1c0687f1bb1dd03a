"""``python -m ppcompile demo``: a PP pipeline of a reference model, eager and ``pp_breakable`` side by side.

Runs a stream of varlen batches whose total token counts go from 1 token to above the capture cap through
two :class:`~ppcompile.pipeline.InProcessPipeline` instances with the same weights, and prints one row per
forward: the path each stage took (graph or eager), the bucket, the largest logits difference and both
wall times. Exits non-zero when a difference exceeds the tolerance.

With ``--distributed`` every stage runs in its own process over torch.distributed (gloo on CPU, NCCL on
GPU): under ``torchrun --nproc-per-node N -m ppcompile demo --distributed`` this process is one rank;
without torchrun, ``--pp N`` ranks are spawned. With ``--tp T`` each stage is tensor-parallel over ``T``
ranks (``--pp N --tp T``: ``N * T`` ranks, a stage's TP ranks consecutive). The last rank compares its
logits with an in-process eager reference of the full model and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import math
import random
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ppcompile.backends.pp_breakable import stage_runtimes
from ppcompile.cli.args import int_list
from ppcompile.config import GRAPH_MODES, PPBreakableConfig, graph_path_mode
from ppcompile.counters import counters
from ppcompile.models import REFERENCE_CONFIGS, ModelConfig, make_batch
from ppcompile.pipeline import (
    DistributedStage,
    InProcessPipeline,
    MicroBatch,
    init_parallel_groups,
    init_pipeline_group,
    spawn_ranks,
)
from ppcompile.pipeline.groups import DEFAULT_TIMEOUT_S, default_device
from ppcompile.runtime.buckets import BucketPlan, make_bucket_plan

__all__ = ["add_arguments", "check_args", "default_token_stream", "parse_tokens", "run", "run_distributed",
           "split_tokens"]

_DEFAULT_PP = 4

_MAX_SEQ_LEN = 256  # long batches are split into sequences of at most this many tokens (attention is O(n^2))
_ATOL = {torch.float32: 1e-4, torch.float64: 1e-8, torch.float16: 5e-2, torch.bfloat16: 1e-1}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's command-line options."""
    parser.add_argument("--config", default="small-moe", choices=sorted(REFERENCE_CONFIGS),
                        help="reference model config (default: small-moe)")
    parser.add_argument("--pp", type=int, default=None,
                        help="pipeline-parallel stages (default: 4; under torchrun: the world size)")
    parser.add_argument("--max-capture-tokens", type=int, default=None,
                        help="cap of the default bucket ladder (default: the backend's, 8192)")
    parser.add_argument("--capture-sizes", type=int_list, default=None,
                        help="explicit buckets, comma-separated (overrides --max-capture-tokens)")
    parser.add_argument("--graph-mode", choices=GRAPH_MODES, default=None,
                        help="graph_mode option (default: cuda on a GPU, else emulate: the demo shows the "
                             "graph path, which 'auto' does not take on CPU)")
    parser.add_argument("--tokens", type=parse_tokens, default=None,
                        help="batches, comma-separated: a total count (split into sequences) or "
                             "'+'-joined sequence lengths, e.g. 1,17,8+9+20 (default: 1 to above the cap)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random varlen mixes and inputs")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: the reference models are tiny)")
    parser.add_argument("--atol", type=float, default=None,
                        help="tolerance on logits (default: 1e-4 for float32)")
    parser.add_argument("--distributed", action="store_true",
                        help="one process per stage over torch.distributed: this process is one rank under "
                             "torchrun, otherwise --pp ranks are spawned")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel ranks per stage, with --distributed (default 1)")
    parser.add_argument("--depth", type=int, default=1,
                        help="micro-batches in flight per rank, with --distributed: sends outstanding while "
                             "the stage computes, receives posted ahead (default 1)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                        help="torch.distributed backend (default: nccl under torchrun with CUDA, else gloo)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="process-group timeout in seconds: a stalled send or recv fails after it "
                             f"(default: {DEFAULT_TIMEOUT_S:g})")


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


def _path_column(paths: Sequence[str], buckets: Sequence[int | None]) -> tuple[str, str]:
    """``("graph x4", "16")`` or ``("graph/eager/...", "8,16")``: the path and bucket columns of a row."""
    path = f"{paths[0]} x{len(paths)}" if len(set(paths)) == 1 else "/".join(paths)
    return path, ",".join(map(str, sorted({b for b in buckets if b is not None}))) or "-"


def _print_table_header(time_label: str) -> None:
    header = (f"{'#':>3} {'tokens':>7} {'seqs':>4}  {'path (per stage)':<26} {'bucket':>6} "
              f"{'max|diff|':>10} {'eager ms':>9} {time_label:>9}  note")
    print(header)
    print("-" * len(header))


def _timed_eager(
    eager: InProcessPipeline, ids: torch.Tensor | None, pos: torch.Tensor, lens: list[int]
) -> tuple[torch.Tensor, float]:
    """The eager pipeline's logits for one batch and the milliseconds they took."""
    with torch.inference_mode():
        t = time.perf_counter()
        want = eager(ids, pos, lens)
        return want, 1e3 * (time.perf_counter() - t)


def _paths(pipe: InProcessPipeline) -> tuple[str, str]:
    return _path_column([t.path if t else "?" for t in pipe.traces],
                        [t.bucket if t else None for t in pipe.traces])


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What every demo process derives from the arguments alone (the same on every rank)."""

    cfg: ModelConfig
    options: dict[str, object]
    plan: BucketPlan
    batches: list[list[int]]  # sequence lengths of each forward
    atol: float
    warm: int

    @classmethod
    def of(cls, args: argparse.Namespace, device: torch.device) -> _Setup:
        """``device``: where the stages run, which picks the default graph mode."""
        cfg = REFERENCE_CONFIGS[args.config]
        # The graph path on every device: "auto" would serve CPU stages at the live size, no buckets.
        options: dict[str, object] = {"graph_mode": args.graph_mode or graph_path_mode(device.type)}
        if args.capture_sizes:
            options["capture_sizes"] = args.capture_sizes
        elif args.max_capture_tokens is not None:
            options["max_capture_tokens"] = args.max_capture_tokens
        plan = make_bucket_plan(PPBreakableConfig.from_options(options))
        rng = random.Random(args.seed)
        stream = args.tokens if args.tokens is not None else default_token_stream(plan, rng)
        atol = args.atol if args.atol is not None else _ATOL.get(cfg.dtype, 1e-4)
        batches = [_as_seq_lens(item, rng) for item in stream]
        return cls(cfg, options, plan, batches, atol, min(16, plan.cap))

    def banner(self, args: argparse.Namespace, where: str, warm_s: float) -> None:
        cfg, plan = self.cfg, self.plan
        print(f"ppcompile demo: config {args.config} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, "
              f"{cfg.dtype}), {where}, {args.threads} thread(s), options {self.options or '{}'}")
        print(f"buckets: {len(plan.sizes)} up to cap {plan.cap}, max_padding_factor "
              f"{plan.max_padding_factor:g}; compile + capture of every bucket in {warm_s:.1f} s "
              f"(warm-up forward of {self.warm} tokens)")


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the combination of options, if anything (``main`` makes it a usage error)."""
    if args.distributed:
        return None
    if args.tp != 1:
        return (f"--tp {args.tp} needs --distributed (one process per rank): add --distributed, e.g. "
                f"python -m ppcompile demo --distributed --tp {args.tp}")
    if args.depth != 1:
        return (f"--depth {args.depth} needs --distributed (micro-batches in flight between ranks): add "
                "--distributed")
    return None


def run(args: argparse.Namespace) -> int:
    """Runs the demo; returns the process exit code (1 when a difference exceeds the tolerance)."""
    if args.distributed:
        return run_distributed(args)
    if (problem := check_args(args)) is not None:
        raise ValueError(problem)
    setup = _Setup.of(args, torch.device("cpu"))  # InProcessPipeline's device
    cfg, options, atol = setup.cfg, setup.options, setup.atol
    pp = args.pp or _DEFAULT_PP
    torch.set_num_threads(args.threads)

    eager = InProcessPipeline(cfg, pp, compiled=False)
    graphed = InProcessPipeline(cfg, pp, compiled=True, options=options)
    t0 = time.perf_counter()
    ids, pos, _ = make_batch(cfg, [setup.warm], 0, pp, seed=args.seed)
    with torch.inference_mode():
        graphed(ids, pos, [setup.warm])
    setup.banner(args, f"PP{pp} in one process", time.perf_counter() - t0)
    if options["graph_mode"] == "emulate":
        print("note: graphs are emulated on CPU: pp_breakable times show overhead, not a speed-up")
    for rt in stage_runtimes():
        if not rt.eager_reason:
            print(rt.describe())
    _print_table_header("pp_brk ms")
    failures = 0
    for i, lens in enumerate(setup.batches):
        ids, pos, _ = make_batch(cfg, lens, 0, pp, seed=args.seed + i)
        want, eager_ms = _timed_eager(eager, ids, pos, lens)
        with torch.inference_mode():
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
    print(f"{verdict}: {failures} of {len(setup.batches)} forwards differ by more than {atol:g}")
    return 1 if failures else 0


def run_distributed(args: argparse.Namespace) -> int:
    """``--distributed``: one rank under torchrun, else spawns ``--pp`` ranks; returns the exit code."""
    if dist.is_torchelastic_launched():
        init_pipeline_group(backend=args.backend, timeout_s=args.timeout)
        try:
            code, report = _demo_rank(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        print(report, end="", flush=True)
        return code
    world = (args.pp or _DEFAULT_PP) * args.tp
    results = spawn_ranks(_demo_rank, world, args=(args,), backend=args.backend or "gloo",
                          threads=args.threads, timeout_s=None, pg_timeout_s=args.timeout)
    print(results[-1][1], end="", flush=True)
    return max(code for code, _ in results)


def _demo_rank(rank: int, world: int, args: argparse.Namespace) -> tuple[int, str]:
    """One rank of the distributed demo: ``(exit code, report)``; only the last rank has a report."""
    if args.pp is not None and args.pp * args.tp != world:
        raise ValueError(f"--pp {args.pp} x --tp {args.tp} does not match the {world} ranks of the process "
                         "group; drop --pp under torchrun or make --pp x --tp equal to --nproc-per-node")
    torch.set_num_threads(args.threads)
    setup = _Setup.of(args, default_device())
    cfg = setup.cfg
    groups = init_parallel_groups(args.tp)
    pp = groups.pp_size
    stage = DistributedStage(cfg, group=groups.pp_group, options=setup.options, tp=groups.tp,
                             depth=args.depth)
    t0 = time.perf_counter()
    with torch.inference_mode():  # every rank compiles and captures at once, before the first batch
        # proxies made here are inference tensors, like the received ones: no recompile at the first batch
        ids, pos, proxies = make_batch(cfg, [setup.warm], groups.pp_rank, pp, seed=args.seed,
                                       device=stage.device)
        stage.run_local(pos, [setup.warm], input_ids=ids, pp_proxy_tensors=proxies)
    warm_s = time.perf_counter() - t0
    dist.barrier()
    rows: list[tuple[str, int | None, float, int]] = []
    logits: list[torch.Tensor] = []

    def micro_batches() -> Iterator[MicroBatch]:
        for i, lens in enumerate(setup.batches):
            ids, pos, _ = make_batch(cfg, lens, 0, pp, seed=args.seed + i, device=stage.device)
            yield MicroBatch(pos, lens, input_ids=ids)

    compiles = counters.backend_compiles
    with torch.inference_mode():
        for out in stage.run(micro_batches()):
            trace = stage.trace
            assert trace is not None
            rows.append((trace.path, trace.bucket, 1e3 * trace.seconds, counters.backend_compiles - compiles))
            compiles = counters.backend_compiles
            if out is not None:
                logits.append(out.to("cpu", torch.float32, copy=True))
    described = [rt.describe() for rt in stage_runtimes() if not rt.eager_reason]
    mine = (rows, warm_s, described)
    gathered: list[Any] | None = [None] * world if rank == world - 1 else None  # a last stage's rank
    dist.gather_object(mine, gathered, dst=world - 1)
    if gathered is None:
        return 0, ""
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = _report(args, setup, pp, gathered, logits)
    return code, text.getvalue()


def _report(args: argparse.Namespace, setup: _Setup, pp: int, gathered: list[Any],
            logits: list[torch.Tensor]) -> int:
    """The last rank's table: per-rank paths, difference from the in-process eager reference."""
    cfg = setup.cfg
    backend = dist.get_backend()
    world = len(gathered)
    layout = f"PP{pp}" if args.tp == 1 else f"PP{pp} x TP{args.tp}"
    layout += f", {args.depth} micro-batch{'es' if args.depth > 1 else ''} in flight per rank"
    setup.banner(args, f"{layout} over torch.distributed ({backend}, {world} processes)",
                 max(g[1] for g in gathered))
    if setup.options["graph_mode"] == "emulate":
        print("note: graphs are emulated on CPU: pp_breakable times show overhead, not a speed-up")
    for rank, g in enumerate(gathered):
        for text in g[2]:
            print(f"[rank {rank}] {text}")
    eager = InProcessPipeline(cfg, pp, compiled=False)  # the full model: no TP
    _print_table_header("stage ms")
    failures = 0
    for i, lens in enumerate(setup.batches):
        ids, pos, _ = make_batch(cfg, lens, 0, pp, seed=args.seed + i)
        want, eager_ms = _timed_eager(eager, ids, pos, lens)
        diff = (want.float() - logits[i]).abs().max().item()
        rows = [g[0][i] for g in gathered]
        path, bucket = _path_column([r[0] for r in rows], [r[1] for r in rows])
        notes = []
        compiles = sum(r[3] for r in rows)
        if compiles:
            notes.append(f"+{compiles} Dynamo compile(s)")
        if diff > setup.atol:
            notes.append(f"MISMATCH > {setup.atol:g}")
            failures += 1
        print(f"{i:>3} {sum(lens):>7} {len(lens):>4}  {path:<26} {bucket:>6} {diff:>10.2e} "
              f"{eager_ms:>9.1f} {max(r[2] for r in rows):>9.1f}  {'; '.join(notes)}")
    print("eager ms: the whole pipeline in one process; stage ms: the slowest rank's stage forward")
    verdict = "FAIL" if failures else "OK"
    print(f"{verdict}: {failures} of {len(setup.batches)} forwards differ by more than {setup.atol:g}")
    return 1 if failures else 0

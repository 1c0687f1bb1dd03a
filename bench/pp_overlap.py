"""A PP prefill schedule, simulated: bubble fraction and tokens/s of ``send_mode`` wait / copy / ring at
receive depths 1-3, fed with per-stage forward and send times measured on this machine.

The model (``simulate``). ``S`` stages, ``M`` micro-batches of ``T`` tokens, all at stage 0 at time 0.
Stage ``s`` has one serial compute resource; link ``s -> s+1`` one serial transfer resource (FIFO in
micro-batch order). Inputs: forward seconds ``F[s]``, send seconds ``C`` (one micro-batch's packed
proxies over a link), pack seconds ``K`` (copying them into a send buffer, on the sender's compute).

* Receives, depth ``d >= 1``: stage ``s > 0`` posts its receive of micro-batch ``i`` at 0 if ``i < d``,
  else when its forward of ``i - d`` ended (depth 1: a blocking receive after the previous forward).
* Transfer of ``i`` over ``s -> s+1``: starts at max(data ready on ``s``, receive of ``i`` posted on
  ``s+1``, transfer of ``i - 1`` ended), lasts ``C`` (rendezvous, as gloo/NCCL point-to-point).
* Sender modes, as ``DistributedStage``'s ``send_mode`` (``s < S-1``; the last stage sends nothing):
  after forward ``i`` the stage packs its proxies into a send buffer (``K`` on compute), data ready at
  the pack's end. ``ring``: ``d`` buffers; the pack of ``i`` into buffer ``i mod d`` starts no earlier
  than the end of transfer ``i - d`` (the buffer's previous user; the compute stalls). ``copy``: a
  fresh buffer per micro-batch, bounded by the same rule, so it schedules as ``ring`` does (it differs
  in memory). ``wait``: forward ``i + 1`` starts no earlier than the end of transfer ``i``.
* Forward ``i`` on ``s`` starts at max(compute free, transfer of ``i`` into ``s`` ended, the mode's rule).

Every event depends only on earlier micro-batches, or on earlier stages of the same one, so the schedule
is one pass in micro-batch order, stage by stage: what an event queue would compute, exactly.
Makespan: the last forward's end on the last stage; bubble fraction ``1 - sum_s M F[s] / (S makespan)``
(packs count as bubble); tokens/s ``M T / makespan``.

Measured (``main``): ``F[s]``, the reference model split into PP4, each stage compiled with
``pp_breakable`` (``graph_mode="emulate"``, one captured bucket of ``T`` tokens), median of timed
forwards after warm-up; ``C``, gloo send + recv of the packed proxy bytes between two ranks on
loopback (half a ping-pong's median); ``K``, the median copy of the proxies into a preallocated byte
buffer. Figures are from one run on one machine.

Run: ``python bench/pp_overlap.py [--suite default|tiny] [--no-docs]`` (writes the "PP schedule
(simulated)" section of docs/benchmarks.md unless ``--no-docs``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

__all__ = ["MODES", "SUITES", "Inputs", "Schedule", "Suite", "markdown", "measure", "simulate"]

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
MODES = ("wait", "copy", "ring")
DEPTHS = (1, 2, 3)
C_SCALES = (1, 4, 16)
PP = 4
SEND_WARMUP = 10  # ping-pongs untimed: the first few over a new gloo pair take milliseconds


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One simulated schedule: makespan, bubble fraction, tokens/s and each stage's busy seconds
    (forwards plus packs)."""

    mode: str
    depth: int
    makespan_s: float
    bubble_fraction: float
    tokens_per_s: float
    busy_s: tuple[float, ...]


def simulate(forward_s: Sequence[float], send_s: float, pack_s: float, micro_batches: int, tokens: int,
             mode: str, depth: int) -> Schedule:
    """The schedule of the module docstring's model, for stages with forward seconds ``forward_s``."""
    stages, m, d, f = len(forward_s), micro_batches, depth, [float(x) for x in forward_s]
    if stages < 1:
        raise ValueError("simulate: forward_s must give one forward time per stage (S >= 1), got none")
    for name, value in (("micro_batches", m), ("tokens", tokens), ("depth", d)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"simulate: {name} must be an int >= 1, got {value!r}")
    if mode not in MODES:
        raise ValueError(f"simulate: mode must be one of {MODES}, got {mode!r}")
    for name, x in [*((f"forward_s[{s}]", v) for s, v in enumerate(f)), ("send_s", send_s),
                    ("pack_s", pack_s)]:
        if not math.isfinite(x) or x < 0:
            raise ValueError(f"simulate: {name} must be a finite number of seconds >= 0, got {x!r}")
    pack = float(pack_s)
    fwd_end = [[0.0] * m for _ in range(stages)]
    xfer_end = [[0.0] * m for _ in range(stages - 1)]  # link s -> s+1
    free = [0.0] * stages
    for i in range(m):
        for s in range(stages):
            start = free[s]
            if s > 0:
                start = max(start, xfer_end[s - 1][i])
            if mode == "wait" and s < stages - 1 and i > 0:
                start = max(start, xfer_end[s][i - 1])  # its outputs are read by the send in flight
            fwd_end[s][i] = free[s] = start + f[s]
            if s == stages - 1:
                continue
            slot_free = xfer_end[s][i - d] if mode != "wait" and i >= d else 0.0
            ready = free[s] = max(fwd_end[s][i], slot_free) + pack
            posted = fwd_end[s + 1][i - d] if i >= d else 0.0
            link = xfer_end[s][i - 1] if i > 0 else 0.0
            xfer_end[s][i] = max(ready, posted, link) + send_s
    makespan = fwd_end[-1][-1]
    busy = tuple(m * f[s] + (m * pack if s < stages - 1 else 0.0) for s in range(stages))
    bubble = 1.0 - sum(m * x for x in f) / (stages * makespan) if makespan > 0 else 0.0
    rate = m * tokens / makespan if makespan > 0 else math.inf
    return Schedule(mode, d, makespan, bubble, rate, busy)


# ------------------------------------------------------------------------------------------ measurement
@dataclasses.dataclass(frozen=True)
class Suite:
    """Sizes of one run: the reference preset split into PP4, tokens per micro-batch, repeats."""

    preset: str
    tokens: int
    micro_batches: int
    warmup: int
    repeats: int  # timed forwards per stage
    send_repeats: int  # ping-pongs and copies


SUITES: dict[str, Suite] = {
    "default": Suite("small-dense", tokens=256, micro_batches=16, warmup=3, repeats=15, send_repeats=50),
    "tiny": Suite("tiny", tokens=16, micro_batches=8, warmup=1, repeats=3, send_repeats=20),
}


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What the simulation is fed: per-stage forward seconds, send and pack seconds, payload bytes."""

    forward_s: tuple[float, ...]
    send_s: float
    pack_s: float
    payload_bytes: int
    fields: tuple[str, ...]


def _forward_seconds(suite: Suite) -> list[float]:
    import ppcompile
    from ppcompile.models import (
        REFERENCE_CONFIGS,
        make_batch,
        make_forward_context,
        make_stage,
        set_forward_context,
    )
    from ppcompile.pipeline.inprocess import STAGE_RECOMPILE_LIMIT
    from ppcompile.torch_internals import raise_recompile_limit

    cfg, lens = REFERENCE_CONFIGS[suite.preset], [suite.tokens]
    raise_recompile_limit(STAGE_RECOMPILE_LIMIT)  # the stages share one forward code object
    options: dict[str, Any] = {"graph_mode": "emulate", "capture_sizes": [suite.tokens]}
    seconds = []
    for rank in range(PP):
        stage = make_stage(cfg, rank, PP)
        compiled = torch.compile(stage, backend="pp_breakable", options=options)
        ids, pos, proxies = make_batch(cfg, lens, rank, PP, seed=rank)
        ppcompile.mark_token_dynamic(ids, pos, proxies)
        ctx = make_forward_context(lens, cfg, range(stage.start_layer, stage.end_layer))
        times, replays = [], ppcompile.counters.replays
        with torch.inference_mode(), set_forward_context(ctx):
            for k in range(suite.warmup + suite.repeats):
                start = time.perf_counter()
                compiled(ids, pos, proxies)
                if k >= suite.warmup:
                    times.append(time.perf_counter() - start)
        if ppcompile.counters.replays - replays != suite.warmup + suite.repeats:
            raise RuntimeError(f"pp_overlap: stage {rank}'s forwards of {suite.tokens} tokens were not all "
                               "graph replays; the figures would not be the graph path's")
        seconds.append(statistics.median(times))
    return seconds


def _ping_pong_worker(rank: int, world_size: int, nbytes: int, warmup: int, repeats: int) -> list[float]:
    """Rank 0 sends ``nbytes`` to rank 1 and gets them back; returns half of each round trip (rank 0)."""
    import torch.distributed as dist

    buf, peer, halves = torch.zeros(nbytes, dtype=torch.uint8), 1 - rank, []
    for k in range(warmup + repeats):
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
        if k >= warmup:
            halves.append((time.perf_counter() - start) / 2)
    return halves if rank == 0 else []


def _pack_seconds(proxies: dict[str, torch.Tensor], repeats: int) -> float:
    """Median seconds to copy ``proxies`` into views of one preallocated byte buffer."""
    sizes = [t.numel() * t.element_size() for t in proxies.values()]
    buf, offsets = torch.empty(sum(sizes), dtype=torch.uint8), [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    views = [buf[a:b].view(t.dtype).view(t.shape) for t, a, b in zip(proxies.values(), offsets, offsets[1:])]
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for dst, src in zip(views, proxies.values()):
            dst.copy_(src)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def measure(suite: Suite) -> Inputs:
    """Per-stage forward seconds, send and pack seconds of one micro-batch of ``suite.tokens`` tokens."""
    from ppcompile.models import REFERENCE_CONFIGS, make_batch
    from ppcompile.pipeline import spawn_ranks

    cfg = REFERENCE_CONFIGS[suite.preset]
    _, _, received = make_batch(cfg, [suite.tokens], 1, PP)  # what every stage but the last hands over
    assert received is not None
    proxies = {k: received[k] for k in received}
    nbytes = sum(t.numel() * t.element_size() for t in proxies.values())
    halves = spawn_ranks(_ping_pong_worker, 2, args=(nbytes, SEND_WARMUP, suite.send_repeats), threads=1,
                         timeout_s=120)[0]
    return Inputs(tuple(_forward_seconds(suite)), statistics.median(halves),
                  _pack_seconds(proxies, suite.send_repeats), nbytes, tuple(proxies))


# ------------------------------------------------------------------------------------------ report
def run(inputs: Inputs, suite: Suite, micro_batches: int) -> dict[str, Any]:
    """Schedules of every mode and depth, and of every mode at depth 2 with ``C`` scaled."""
    def sim(mode: str, depth: int, scale: int = 1) -> Schedule:
        return simulate(inputs.forward_s, inputs.send_s * scale, inputs.pack_s, micro_batches, suite.tokens,
                        mode, depth)

    grid = [sim(mode, depth) for mode in MODES for depth in DEPTHS]
    scaled = {scale: [sim(mode, 2, scale) for mode in MODES] for scale in C_SCALES}
    return {"grid": grid, "scaled": scaled}


def markdown(inputs: Inputs, suite: Suite, micro_batches: int, result: dict[str, Any], machine: str) -> str:
    from bench.report import markdown_table

    base = next(r for r in result["grid"] if (r.mode, r.depth) == ("wait", 1))
    rows = [[r.mode, r.depth, f"{r.makespan_s * 1e3:.2f}", f"{r.bubble_fraction * 100:.1f}",
             f"{r.tokens_per_s:,.0f}", f"{r.tokens_per_s / base.tokens_per_s:.3f}"] for r in result["grid"]]
    sens = [[f"x{scale} ({inputs.send_s * scale * 1e6:.0f} us)",
             *(f"{r.bubble_fraction * 100:.1f}" for r in runs), *(f"{r.tokens_per_s:,.0f}" for r in runs)]
            for scale, runs in result["scaled"].items()]
    at2 = {r.mode: r.bubble_fraction for r in result["grid"] if r.depth == 2}
    met = at2["ring"] <= at2["copy"] and at2["ring"] < at2["wait"]
    forwards = ", ".join(f"{x * 1e3:.3f}" for x in inputs.forward_s)
    return "\n".join([
        "## PP schedule (simulated): send_mode wait / copy / ring", "",
        "A discrete-event simulation of a PP4 prefill schedule (model and rules: the docstring of "
        "`bench/pp_overlap.py`), fed with times measured on this machine: CPU only, gloo over loopback, "
        f"{machine}. Figures are from one run.", "",
        f"Inputs: reference preset `{suite.preset}` split into PP4, each stage compiled with pp_breakable "
        f"(`graph_mode=\"emulate\"`, one captured bucket of {suite.tokens} tokens), {micro_batches} "
        f"micro-batches of {suite.tokens} tokens. Forward ms per stage (median of {suite.repeats}): "
        f"{forwards}. Send C = {inputs.send_s * 1e6:.1f} us (gloo send + recv of {inputs.payload_bytes} "
        f"packed bytes, {' + '.join(inputs.fields)}; half a ping-pong, median of {suite.send_repeats}). "
        f"Pack K = {inputs.pack_s * 1e6:.1f} us (copy into a byte buffer, median of "
        f"{suite.send_repeats}). Bubble counts packs as idle.", "",
        markdown_table(["mode", "depth", "makespan ms", "bubble %", "tokens/s", "tokens/s vs wait d1"], rows),
        "", "Sensitivity at depth 2, C scaled (loopback sends are cheap next to a forward):", "",
        markdown_table(["C", *(f"{m} bubble %" for m in MODES), *(f"{m} tokens/s" for m in MODES)], sens),
        "", f"Target (PP4, depth 2, measured C): ring bubble {at2['ring'] * 100:.2f}% <= copy "
        f"{at2['copy'] * 100:.2f}% and < wait {at2['wait'] * 100:.2f}%: {'met' if met else 'NOT met'}. "
        "ring and copy schedule alike (both wait for the send of micro-batch i - d before packing i); "
        "they differ in memory: ring allocates its d buffers once.",
    ])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--suite", choices=sorted(SUITES), default="default")
    parser.add_argument("--micro-batches", type=int, default=None, help="M (default: the suite's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--no-docs", dest="docs", action="store_false", help="do not touch the docs")
    parser.add_argument("--docs-file", type=Path, default=DOC, help="markdown file to write")
    args = parser.parse_args(argv)
    from bench.report import describe_machine, machine_info, update_markdown_section

    torch.set_num_threads(args.threads)
    suite = SUITES[args.suite]
    micro_batches = args.micro_batches or suite.micro_batches
    machine = describe_machine(machine_info("cpu", args.threads))
    inputs = measure(suite)
    text = markdown(inputs, suite, micro_batches, run(inputs, suite, micro_batches), machine)
    print(text)
    if args.docs:
        update_markdown_section(args.docs_file, "pp-overlap", text)
        print(f"\nwrote {args.docs_file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

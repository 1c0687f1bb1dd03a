"""Two PP stages on one device with the hand-over on a second stream: does the output ring let stage 0
compute micro-batch i + 1 while micro-batch i is handed over, with no host synchronisation?

Stages 0 and 1 of a PP2 split of the reference decoder, compiled with pp_breakable on the graph path,
one bucket. The hand-over stands for a PP send: on a side stream, stage 0's proxies go to pinned host
memory and back into stage 1's receive buffers (a network hop's bandwidth, not HBM's). Variants, each
``M`` micro-batches, wall time per micro-batch:

* ``ring``: ``output_slots=2``; the event recorded after hand-over ``i`` is handed to
  ``ppcompile.fence_outputs``, so forward ``i + 2`` waits for it on the device; the loop never waits.
* ``wait``: ``output_slots=1``; the compute stream waits for hand-over ``i`` before forward ``i + 1``
  (the send-safety rule, as a stream dependency).
* ``compute``: the stages alone (the compute stream's busy time); ``handover``: the hand-overs alone.

``overlap = (wait - ring) / min(compute, handover)``: 1 when the ring hides the hand-over entirely.
Each variant runs under ``torch.cuda.set_sync_debug_mode("warn")``; the warnings (host
synchronisations) are counted. On CPU (no streams) the same loop runs inline to test this script; its
figures mean nothing there.

Run: ``python bench/pp_streams.py [--tokens T] [--micro-batches M] [--out DIR]`` (writes pp_streams.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import ppcompile
from bench.common import StageSpec
from ppcompile.models import make_batch
from ppcompile.pipeline import InProcessPipeline

__all__ = ["VARIANTS", "main", "run_variant"]

VARIANTS = ("compute", "handover", "wait", "ring")


class _Pipe:
    """The two compiled stages, their inputs, and two slots of hand-over buffers (pinned staging and
    stage 1's receive buffers): stage 1 reads slot ``i mod 2`` while hand-over ``i + 1`` fills the other."""

    def __init__(self, spec: StageSpec, tokens: int, slots: int, device: torch.device) -> None:
        self.cfg = spec.model_config()
        mode = "cuda" if device.type == "cuda" else "emulate"
        self.pipe = InProcessPipeline(self.cfg, 2, compiled=True, device=device, options={
            "graph_mode": mode, "capture_sizes": [tokens], "output_slots": slots})
        self.lens = [tokens]
        self.ids, self.pos, _ = make_batch(self.cfg, self.lens, 0, 2, device=device)
        self.device = device
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        out = self.first()
        pin = device.type == "cuda"
        self.staging = [{k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pin) for k, v in out.items()}
                        for _ in range(2)]
        self.received = [{k: torch.empty_like(v) for k, v in out.items()} for _ in range(2)]

    def first(self) -> Any:
        return self.pipe.run_stage(0, self.pos, self.lens, input_ids=self.ids)

    def second(self, slot: int) -> Any:
        proxies = ppcompile.PPProxyTensors(dict(self.received[slot]))
        return self.pipe.run_stage(1, self.pos, self.lens, pp_proxy_tensors=proxies)

    def hand_over(self, out: Any, slot: int) -> Any:
        """Starts handing ``out`` over into ``slot`` on the side stream, after all the compute enqueued
        so far; returns its end event (None on CPU, where it runs inline)."""
        if self.side is None:
            for k, v in out.items():
                self.staging[slot][k].copy_(v)
                self.received[slot][k].copy_(self.staging[slot][k])
            return None
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            for k, v in out.items():
                self.staging[slot][k].copy_(v, non_blocking=True)
                self.received[slot][k].copy_(self.staging[slot][k], non_blocking=True)
            return self.side.record_event()

    def wait(self, event: Any) -> None:
        """The compute stream waits for ``event`` (a device dependency; nothing on CPU)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


@contextlib.contextmanager
def _counted_syncs(device: torch.device) -> Iterator[list[warnings.WarningMessage]]:
    """Counts host synchronisations (CUDA's sync debug mode warnings) inside the block."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)


def run_variant(pipe: _Pipe, variant: str, micro_batches: int) -> dict[str, Any]:
    """Wall seconds per micro-batch of one variant, and the host synchronisations it made. Per micro-batch
    ``i``: stage 0's forward, the start of hand-over ``i``, then stage 1 on micro-batch ``i - 1``."""
    if variant not in VARIANTS:
        raise ValueError(f"pp_streams: variant must be one of {VARIANTS}, got {variant!r}")
    out = pipe.first()
    _sync(pipe.device)
    start = time.perf_counter()
    with torch.inference_mode(), _counted_syncs(pipe.device) as syncs:
        arrived = None  # the end event of the previous hand-over
        for i in range(micro_batches):
            if variant == "handover":
                pipe.hand_over(out, i % 2)
                continue
            out = pipe.first()
            done = None
            if variant != "compute":
                done = pipe.hand_over(out, i % 2)
                if variant == "ring":  # on CPU the hand-over ran inline: a no-op fence
                    ppcompile.fence_outputs(out, done if done is not None else _done)
                else:  # "wait": the next forward may overwrite what the hand-over reads
                    pipe.wait(done)
            if i > 0:
                pipe.wait(arrived)  # stage 1 reads what arrived
                pipe.second((i - 1) % 2)
            arrived = done
        if variant != "handover":
            pipe.wait(arrived)
            pipe.second((micro_batches - 1) % 2)
    _sync(pipe.device)
    seconds = (time.perf_counter() - start) / micro_batches
    return {"variant": variant, "ms_per_micro_batch": seconds * 1e3,
            "host_syncs": sum("synchroniz" in str(w.message).lower() for w in syncs)}


def _done() -> None:
    """The fence of a hand-over that already completed."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per micro-batch (one bucket)")
    parser.add_argument("--micro-batches", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="folder for pp_streams.json")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    spec = (StageSpec(layers=4, hidden=1024, dtype="bfloat16", pp_size=2, device="cuda") if cuda
            else StageSpec(preset="tiny", pp_size=2))
    tokens = args.tokens or (4096 if cuda else 16)
    rows = []
    with torch.inference_mode():
        pipes = {slots: _Pipe(spec, tokens, slots, device) for slots in (1, 2)}
        for variant in VARIANTS:
            pipe = pipes[2 if variant == "ring" else 1]
            run_variant(pipe, variant, 2)  # warm
            rows.append(run_variant(pipe, variant, args.micro_batches))
    ms = {r["variant"]: r["ms_per_micro_batch"] for r in rows}
    hidden = min(ms["compute"], ms["handover"])
    result = {"device": str(device), "stage": spec.describe(), "tokens": tokens,
              "micro_batches": args.micro_batches, "rows": rows,
              "overlap": (ms["wait"] - ms["ring"]) / hidden if hidden > 0 else None}
    for r in rows:
        print(f"{r['variant']:<9} {r['ms_per_micro_batch']:9.3f} ms per micro-batch, "
              f"host syncs {r['host_syncs']}")
    print(f"overlap (wait - ring) / min(compute, handover): {result['overlap']}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "pp_streams.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

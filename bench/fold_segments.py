"""Where folding a tiny graph segment into the breaks around it starts to cost more than it saves.

A stage of ``blocks`` repeats of: a break (a row-mixing op, run eagerly), then ``k`` cheap elementwise
ops, then the next break. With ``fold_graph_ops=0`` every run of ``k`` ops is a graph segment (a replay,
plus a bridge copy in and live views out around it); with ``fold_graph_ops=k`` the ops run eagerly
inside one merged break. Host time per forward, medians of interleaved calls, for each ``k``; the
largest ``k`` where folding is still faster is the crossover that ``DEFAULT_FOLD_GRAPH_OPS`` follows.

Run alone: ``python bench/fold_segments.py [--device cpu|cuda] [--graph-mode emulate|eager|cuda]``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import ppcompile
from ppcompile.config import graph_path_mode

__all__ = ["run_fold"]


class Blocks(torch.nn.Module):
    """``blocks`` x (cumsum-then-flip, a row-mixing break; ``k`` multiply-adds)."""

    def __init__(self, k: int, blocks: int, hidden: int) -> None:
        super().__init__()
        self.k, self.blocks = k, blocks
        self.scale = torch.nn.Parameter(torch.linspace(0.9, 1.1, hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.blocks):
            x = x.flip(0)  # a break: reverses the rows
            for _ in range(self.k):
                x = x * self.scale  # one kernel each
        return x


def _time(fn: object, x: torch.Tensor, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(x)  # type: ignore[operator]
        if x.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def run_fold(device: str, graph_mode: str, ks: list[int], blocks: int = 16, tokens: int = 12,
             calls: int = 200, on_row: Callable[[tuple[int, float, float]], None] | None = None
             ) -> list[tuple[int, float, float]]:
    """(k, us per forward unfolded, us per forward folded) for each k; ``on_row`` gets each row as soon as
    it is measured (a cut-off run keeps them)."""
    rows = []
    for k in ks:
        stage = Blocks(k, blocks, 64).to(device)
        compiled = {}
        for fold in (0, k):
            torch._dynamo.reset()
            options = {"capture_sizes": [16], "graph_mode": graph_mode, "fold_graph_ops": fold}
            compiled[fold] = torch.compile(Blocks(k, blocks, 64).to(device), backend="pp_breakable",
                                           options=options)
            x = torch.randn(tokens, 64, device=device)
            ppcompile.mark_token_dynamic(x)
            with torch.no_grad():
                compiled[fold](x)  # compile + capture
                torch.testing.assert_close(compiled[fold](x), stage(x))
        x = torch.randn(tokens, 64, device=device)
        gc.disable()
        try:
            with torch.no_grad():
                samples: dict[int, list[float]] = {0: [], k: []}
                for _ in range(5):  # interleaved rounds
                    for fold in (0, k):
                        samples[fold].append(_time(compiled[fold], x, calls // 5))
        finally:
            gc.enable()
        rows.append((k, statistics.median(samples[0]), statistics.median(samples[k])))
        if on_row is not None:
            on_row(rows[-1])
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--graph-mode", default=None, help="default: cuda on a GPU, else emulate")
    parser.add_argument("--ks", default="1,2,3,4,6,8")
    args = parser.parse_args()
    mode = args.graph_mode or graph_path_mode(torch.device(args.device).type)
    torch.set_num_threads(1)
    print(f"| ops between breaks | unfolded us/forward | folded us/forward | folded / unfolded |  ({mode})")
    print("|---|---|---|---|", flush=True)

    def show(row: tuple[int, float, float]) -> None:
        k, unfolded, folded = row
        print(f"| {k} | {unfolded:.0f} | {folded:.0f} | {folded / unfolded:.2f} |", flush=True)

    run_fold(args.device, mode, [int(k) for k in args.ks.split(",")], on_row=show)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

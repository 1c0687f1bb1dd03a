"""Measures ``graph_gain_tokens`` on this device: what one graph replay saves over eager, in tokens.

For each probe size ``n`` (each its own bucket, so no padding), a reference stage runs eagerly and
through ``pp_breakable`` on the graph path (CUDA graphs on a GPU, the CPU emulation elsewhere);
medians of interleaved calls. The per-token cost is the slope of the graph path's time over ``n``
(least squares); the gain at ``n`` is ``(eager(n) - graph(n)) / slope``, and the probe's value is the
median over sizes. On CPU the emulation re-runs every segment and copies its outputs, so it saves
nothing and the value is about zero or negative: the figure that matters comes from a GPU.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import ppcompile
from ppcompile.config import graph_path_mode
from ppcompile.models import (
    REFERENCE_CONFIGS,
    make_batch,
    make_forward_context,
    make_stage,
    set_forward_context,
)
from ppcompile.torch_internals import reset_dynamo

__all__ = ["GainProbe", "probe_graph_gain"]


@dataclasses.dataclass(frozen=True)
class GainProbe:
    """Seconds per forward by size, eager and graphed, and the gain in tokens they imply."""

    device: str
    graph_mode: str
    sizes: tuple[int, ...]
    eager_s: tuple[float, ...]
    graph_s: tuple[float, ...]
    seconds_per_token: float
    gain_tokens: tuple[float, ...]

    @property
    def graph_gain_tokens(self) -> float:
        """The median gain over the probed sizes (the value to pass to ``plan_buckets``)."""
        return statistics.median(self.gain_tokens)


def _timed(fn: Callable[[], Any], device: str, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def probe_graph_gain(
    sizes: Sequence[int] = (16, 32, 64, 128), *, model: str = "tiny", device: str = "cpu", calls: int = 20
) -> GainProbe:
    """Times eager vs graphed forwards of the ``model`` reference stage (one rank) at ``sizes``."""
    sizes = tuple(sorted(set(sizes)))
    if len(sizes) < 2 or sizes[0] < 2:
        raise ValueError(f"probe_graph_gain: need two or more sizes >= 2, got {list(sizes)}")
    if model not in REFERENCE_CONFIGS:
        raise ValueError(f"probe_graph_gain: unknown model {model!r}; known: {sorted(REFERENCE_CONFIGS)}")
    cfg = REFERENCE_CONFIGS[model]
    reset_dynamo()
    stage = make_stage(cfg, 0, 1).to(device)
    # The graph path on every device ("auto" would serve CPU stages at the live size, with no replays).
    graph_mode = graph_path_mode(torch.device(device).type)
    options: dict[str, Any] = {"capture_sizes": list(sizes), "graph_mode": graph_mode}
    compiled = torch.compile(stage, backend="pp_breakable", options=options)
    eager_s, graph_s = [], []
    mode = "?"
    for i, n in enumerate(sizes):
        ids, pos, _ = make_batch(cfg, [n], 0, 1, seed=n)
        assert ids is not None  # rank 0 of 1: the stage embeds input ids
        ids, pos = ids.to(device), pos.to(device)
        if i == 0:
            ppcompile.mark_token_dynamic(ids, pos)

        def run(module: Any, ids: torch.Tensor = ids, pos: torch.Tensor = pos, n: int = n) -> None:
            context = make_forward_context([n], cfg, range(cfg.num_layers), device=device)
            with torch.inference_mode(), set_forward_context(context):
                module(ids, pos, None)

        run(compiled)  # compile and capture
        mode = ppcompile.stage_runtimes()[-1].graph_mode
        rounds = [(_timed(lambda: run(stage), device, calls), _timed(lambda: run(compiled), device, calls))
                  for _ in range(3)]
        eager_s.append(min(r[0] for r in rounds))
        graph_s.append(min(r[1] for r in rounds))
    mean_n, mean_t = statistics.fmean(sizes), statistics.fmean(graph_s)
    slope = (sum((n - mean_n) * (t - mean_t) for n, t in zip(sizes, graph_s))
             / sum((n - mean_n) ** 2 for n in sizes))
    per_token = max(slope, 1e-12)
    gains = tuple((e - g) / per_token for e, g in zip(eager_s, graph_s))
    return GainProbe(device, mode, sizes, tuple(eager_s), tuple(graph_s), per_token, gains)

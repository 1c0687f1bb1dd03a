"""Whole-stage graphs in a TP group of two gloo ranks: the all-reduce inside the whole graph, one decision
per group (the ranks agree on each capture's bucket), and the same answer as one rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from whole_stage_toy import make_meta  # also declares pptest::causal_mix capturable, in every rank

import ppcompile
from ppcompile.pipeline import spawn_ranks

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

HIDDEN, FFN = 8, 16
BATCHES = ([3], [2, 2], [1, 1, 2], [2], [5, 4], [1, 6, 1])  # whole (4, 4, 4, 2), breakable, whole (8)
OPTIONS = {"capture_sizes": [2, 4, 8, 16], "graph_mode": "emulate", "whole_graph_tokens": 8}


class _Layer(torch.nn.Module):
    def __init__(self, up: torch.Tensor, down: torch.Tensor, slots: int) -> None:
        super().__init__()
        self.up = torch.nn.Parameter(up, requires_grad=False)
        self.down = torch.nn.Parameter(down, requires_grad=False)
        self.register_buffer("cache", torch.zeros(slots, HIDDEN), persistent=False)


class MixTP(torch.nn.Module):
    """Per layer: a column- and row-parallel MLP whose partial sums are all-reduced, then ``causal_mix``
    with the layer's cache; rank ``rank`` of ``size`` holds its shard of the same full weights."""

    def __init__(self, size: int, rank: int, group: Any, layers: int = 2, slots: int = 64) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        shard = slice(rank * FFN // size, (rank + 1) * FFN // size)
        self.group, self.size = group, size
        full = [(torch.randn(FFN, HIDDEN, generator=gen) * 0.1, torch.randn(HIDDEN, FFN, generator=gen) * 0.1)
                for _ in range(layers)]
        self.layers = torch.nn.ModuleList(_Layer(up[shard].clone(), down[:, shard].clone(), slots)
                                          for up, down in full)

    def forward(self, x: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = torch.relu(torch.nn.functional.linear(x, layer.up))
            partial = torch.nn.functional.linear(hidden, layer.down)
            if self.size > 1:
                partial = funcol.all_reduce(partial, "sum", self.group)
            x = x + torch.ops.pptest.causal_mix(x + partial, layer.cache, starts, slots)
        return x

    def caches(self) -> torch.Tensor:
        return torch.stack([layer.cache for layer in self.layers])


def _run(model: torch.nn.Module, compiled: bool) -> tuple[list[torch.Tensor], list[str]]:
    fn = torch.compile(model, backend="pp_breakable", dynamic=True, options=OPTIONS) if compiled else model
    outs, paths = [], []
    with torch.inference_mode():
        for k, lens in enumerate(BATCHES):
            x = torch.randn(sum(lens), HIDDEN, generator=torch.Generator().manual_seed(k))
            starts, slots = make_meta(lens, first_slot=4 * k)
            whole, replays = ppcompile.counters.whole_replays, ppcompile.counters.replays
            outs.append(fn(x, starts, slots).clone())
            paths.append("whole" if ppcompile.counters.whole_replays > whole else
                         "breakable" if ppcompile.counters.replays > replays else "eager")
    return outs, paths


def _worker(rank: int, world: int) -> dict[str, Any]:
    group = dist.new_group(list(range(world)))
    torch._dynamo.reset()
    model = MixTP(world, rank, group)
    outs, paths = _run(model, compiled=True)
    (runtime,) = [rt for rt in ppcompile.runtimes_of(model) if rt.token_symbol is not None]
    (state,) = runtime.instances()
    assert state.whole is not None
    return {"outs": outs, "paths": paths, "captured": state.whole.captured_buckets,
            "agreement": runtime.agreement.collectives, "caches": model.caches()}


def test_tp2_whole_stage_graphs_agree_and_equal_one_rank() -> None:
    reference = MixTP(1, 0, None)
    want, _ = _run(reference, compiled=False)
    results = spawn_ranks(_worker, 2, threads=1, timeout_s=240)
    for result in results:
        assert result["paths"] == ["whole", "whole", "whole", "whole", "breakable", "whole"]
        assert result["captured"] == (2, 4, 8)
        for got, expected in zip(result["outs"], want):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(result["caches"], reference.caches(), atol=1e-5, rtol=0)
    assert results[0]["agreement"] == results[1]["agreement"] > 0

"""Whole-stage graphs of the reference models with their capturable attention (``paged_attention=True``):
two PP stages, prefix KV read from the cache, equal to eager at every whole bucket and on the breakable
path above it, under the emulator and the strict CUDA capture double."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from cuda_double import StrictCuda
from hypothesis import given, settings
from hypothesis import strategies as st

import ppcompile
from ppcompile import counters
from ppcompile.models import ModelConfig, make_paged_batch, make_stage
from ppcompile.proxy import PPProxyTensors
from ppcompile.runtime.executors import CudaGraphExecutor

CFG = ModelConfig(num_layers=4, paged_attention=True, block_size=4, blocks_per_request=8, kv_blocks=96)
MOE = CFG.replace(num_experts=4, experts_top_k=2)
OPTIONS = {"capture_sizes": [4, 8, 16, 32, 64], "graph_mode": "emulate", "whole_graph_tokens": 16}
PP = 2
ATOL = 1e-4


class Pipeline:
    """Two compiled stages beside two eager ones, each with caches of its own."""

    def __init__(self, cfg: ModelConfig = CFG, **options: Any) -> None:
        self.cfg = cfg
        self.eager = [make_stage(cfg, r, PP) for r in range(PP)]
        self.stages = [make_stage(cfg, r, PP) for r in range(PP)]
        self.compiled = [torch.compile(s, backend="pp_breakable", dynamic=True,
                                       options={**OPTIONS, **options}) for s in self.stages]

    def _chain(self, stages: Sequence[Any], new: Sequence[int], prefix: Sequence[int] | None) -> torch.Tensor:
        ids, pos, _, meta = make_paged_batch(self.cfg, new, prefix, 0, PP, seed=sum(new))
        out = stages[0](ids, pos, None, meta)
        assert isinstance(out, PPProxyTensors)
        out = stages[1](None, pos, out, meta)
        assert isinstance(out, torch.Tensor)
        return out

    def check(self, new: Sequence[int], prefix: Sequence[int] | None = None) -> str:
        """Runs both pipelines on ``new`` tokens after ``prefix`` cached ones; compares logits and every
        layer's KV cache; returns the compiled path of the last stage ("whole", "breakable", "eager")."""
        with torch.inference_mode():
            want = self._chain(self.eager, new, prefix)
            whole, replays = counters.whole_replays, counters.replays
            got = self._chain(self.compiled, new, prefix)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=f"{new} after {prefix}")
        for mine, theirs in zip(self.stages, self.eager):
            for a, b in zip(mine.modules(), theirs.modules()):
                if hasattr(a, "kv_cache"):
                    torch.testing.assert_close(a.kv_cache, b.kv_cache, atol=ATOL, rtol=0)
        return ("whole" if counters.whole_replays > whole else
                "breakable" if counters.replays > replays else "eager")

    def whole_buckets(self) -> list[tuple[int, ...]]:
        buckets = []
        for c in self.compiled:
            for rt in ppcompile.runtimes_of(c):
                for state in rt.instances():
                    if state.whole is not None:
                        buckets.append(state.whole.captured_buckets)
        return buckets


# (new tokens, cached prefix): a bucket exactly, a bucket + 1, many requests, above whole_graph_tokens,
# above the cap; the first call's sizes differ (Dynamo's duck shaping would tie them otherwise).
CASES: list[tuple[list[int], list[int] | None, str]] = [
    ([3, 2], None, "whole"),
    ([4, 4], [3, 2], "whole"),          # 8: a bucket, reading 5 cached tokens
    ([5, 4], [7, 6], "whole"),          # 9: bucket 16
    ([2, 2, 3, 1, 2, 2, 1, 3], None, "whole"),
    ([12, 10], [4, 4], "breakable"),    # 22 > 16
    ([20, 20, 30], None, "eager"),      # 70 > the cap
    ([1], [5], "whole"),                # 1 token: a static stage graph, served by the symbolic one
]


@pytest.mark.parametrize("cfg", [CFG, MOE], ids=["dense", "moe"])
def test_small_forwards_run_whole_and_equal_eager(fresh_dynamo: None, cfg: ModelConfig) -> None:
    pipe = Pipeline(cfg)
    for new, prefix, path in CASES:
        if prefix:
            pipe.check(prefix)  # prefill the prefix the next call reads
        assert pipe.check(new, prefix) == path, (new, prefix)
    assert all(b for b in pipe.whole_buckets())
    rt = ppcompile.runtimes_of(pipe.compiled[0])[0]
    assert "whole-stage graphs: buckets [4, 8, 16]" in rt.describe()
    for c in pipe.compiled:  # the 1-token graph has no token count of its own (not the block table's width)
        static = [r for r in ppcompile.runtimes_of(c) if r.token_symbol is None]
        assert static and all(r.served_by is not None for r in static)


def test_any_requests_that_fit_equal_eager(fresh_dynamo: None) -> None:
    pipe = Pipeline()
    pipe.check([3, 2])

    @settings(max_examples=12, deadline=None, derandomize=True)
    @given(st.lists(st.integers(1, 4), min_size=2, max_size=6).filter(lambda ls: sum(ls) <= 16),
           st.integers(0, 3))
    def check(new: list[int], prefix: int) -> None:
        prefix_lens = [prefix] * len(new) if prefix else None
        if prefix_lens:
            pipe.check(prefix_lens)
        assert pipe.check(new, prefix_lens) == "whole"

    check()


def test_every_whole_bucket_passes_the_strict_cuda_double(strict_cuda: StrictCuda,
                                                           fresh_dynamo: None) -> None:
    pipe = Pipeline()
    for new, prefix in (([2, 1], None), ([3, 3, 2], [2, 1, 1]), ([6, 5, 4], [1, 1, 1]), ([12, 10], None)):
        if prefix:
            pipe.check(prefix)
        pipe.check(new, prefix)
    assert pipe.whole_buckets() == [(4, 8, 16), (4, 8, 16)]
    executors = [state.whole.executor for c in pipe.compiled for rt in ppcompile.runtimes_of(c)
                 for state in rt.instances() if state.whole is not None]
    assert len(executors) == 2 and all(isinstance(e, CudaGraphExecutor) for e in executors)
    assert strict_cuda.graphs and all(g.replays >= 1 for g in strict_cuda.graphs)

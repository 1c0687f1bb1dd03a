"""Soak property (docs/reliability.md, "Soak"): random streams of forwards over several stage
contracts, interleaved, every output compared to eager; static memory grows only when a capture runs.

Contracts: hidden + residual proxies, hidden-only proxies, an int32 ``topk_indices`` proxy, and hidden +
residual written in place by vLLM-style norms (``in_place_norm``); each a 2-stage split of a tiny
reference decoder (stage 0 takes ``input_ids`` and hands proxies over, stage 1 takes proxies and returns
logits). Token counts favour 1, a bucket exactly, a bucket + 1 and above the
cap. An output of one stage must stay valid across calls of the other stages (invariant 4 is per stage).
``bench/soak.py`` runs the same comparison for 10,000 forwards and reports memory.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ppcompile
from ppcompile.models import (
    REFERENCE_CONFIGS,
    ModelConfig,
    make_batch,
    make_forward_context,
    make_stage,
    set_forward_context,
)

PP = 2
SIZES = [4, 8, 16, 32]
CAP = SIZES[-1]
BASE = REFERENCE_CONFIGS["tiny"].replace(num_layers=2)
CONTRACTS: dict[str, ModelConfig] = {
    "hidden+residual": BASE,
    "hidden-only": BASE.replace(hidden_only=True),
    "topk": BASE.replace(topk_proxy=4),
    "in-place-norm": BASE.replace(in_place_norm=True),  # stage 1 writes the residual it receives
}
EDGES = [1, 2, 4, 5, 8, 9, 16, 17, CAP - 1, CAP, CAP + 1, CAP + 9]

_STAGES: dict[tuple[str, int], tuple[torch.nn.Module, Any]] = {}


def _stage(contract: str, rank: int) -> tuple[torch.nn.Module, Any]:
    """(eager module, compiled module), built once for all examples."""
    key = (contract, rank)
    if key not in _STAGES:
        module = make_stage(CONTRACTS[contract], rank, PP)
        compiled = torch.compile(module, backend="pp_breakable", dynamic=True,
                                 options={"capture_sizes": SIZES, "graph_mode": "emulate"})
        _STAGES[key] = (module, compiled)
    return _STAGES[key]


@pytest.fixture(scope="module", autouse=True)
def _drop_stages() -> Iterator[None]:
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 64  # eight stages share PPStage.forward's code object
    yield
    _STAGES.clear()
    torch._dynamo.config.recompile_limit = limit


def _run(contract: str, rank: int, n: int, seed: int, compiled: bool) -> Any:
    cfg = CONTRACTS[contract]
    module, comp = _stage(contract, rank)
    lens = [n // 2, n - n // 2] if n > 1 and seed % 2 else [n]
    ids, pos, proxies = make_batch(cfg, lens, rank, PP, seed=seed)
    ctx = make_forward_context(lens, cfg, range(module.start_layer, module.end_layer))
    with set_forward_context(ctx):
        return (comp if compiled else module)(ids, pos, pp_proxy_tensors=proxies)


def _same(got: Any, want: Any, what: str) -> None:
    if isinstance(want, Mapping):
        assert sorted(got) == sorted(want), what
        for k in want:
            _same(got[k], want[k], f"{what}[{k}]")
        return
    assert got.shape == want.shape, f"{what}: {tuple(got.shape)} != {tuple(want.shape)}"
    if want.is_floating_point():
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(got, want), what


def _static_bytes() -> dict[Any, int]:
    """Static bytes per live runtime (runtimes of earlier tests may be collected at any time)."""
    return {rt: rt.static_bytes() for rt in ppcompile.stage_runtimes()}


ops = st.lists(
    st.tuples(
        st.sampled_from(sorted(CONTRACTS)),
        st.integers(0, PP - 1),
        st.one_of(st.sampled_from(EDGES), st.integers(1, CAP + 12)),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=50, deadline=None)
@given(stream=ops, seed=st.integers(0, 2**16))
def test_random_interleaved_streams_match_eager(stream: list[tuple[str, int, int]], seed: int) -> None:
    kept: dict[tuple[str, int], tuple[Any, Any]] = {}  # the latest output of each stage, and eager's
    with torch.inference_mode():
        for i, (contract, rank, n) in enumerate(stream):
            before = ppcompile.counters.snapshot()
            bytes_before = _static_bytes()
            got = _run(contract, rank, n, seed + i, compiled=True)
            want = _run(contract, rank, n, seed + i, compiled=False)
            _same(got, want, f"{contract} stage {rank} at {n} tokens")
            kept[(contract, rank)] = (got, want)
            for (c, r), (g, w) in kept.items():  # other stages' outputs are still valid
                _same(g, w, f"{c} stage {r}, kept across a call of {contract} stage {rank}")
            after = ppcompile.counters.snapshot()
            assert after["replays"] + after["eager_runs"] == before["replays"] + before["eager_runs"] + 1
            if after["captures"] == before["captures"]:
                bytes_after = _static_bytes()
                for rt, size in bytes_after.items():
                    assert size == bytes_before.get(rt, 0), f"{rt.name}: grew without a capture"


# A middle stage (rank 1 of 3) hands over the proxies it takes: its outputs can be fed straight back in.
MIDDLE = BASE.replace(num_layers=3)
_MIDDLE: list[tuple[torch.nn.Module, Any]] = []


def _middle() -> tuple[torch.nn.Module, Any]:
    if not _MIDDLE:
        module = make_stage(MIDDLE, 1, 3)
        compiled = torch.compile(module, backend="pp_breakable", dynamic=True,
                                 options={"capture_sizes": SIZES, "graph_mode": "emulate"})
        _MIDDLE.append((module, compiled))
    return _MIDDLE[0]


feeds = st.lists(st.one_of(st.just("feed"), st.sampled_from(EDGES), st.integers(1, CAP + 12)),
                 min_size=2, max_size=8)


@settings(max_examples=30, deadline=None)
@given(stream=feeds, seed=st.integers(0, 2**16))
def test_random_streams_feeding_outputs_back_as_inputs_match_eager(stream: list[Any], seed: int) -> None:
    """``"feed"`` calls the stage on its own previous outputs (views into its static memory on the graph
    path, which the call overwrites while reading them); a number calls it on a fresh batch."""
    module, compiled = _middle()
    prev: tuple[Any, Any] | None = None  # (compiled output, eager output) of the previous call
    with torch.inference_mode():
        for i, step in enumerate(stream):
            if step == "feed" and prev is not None:
                n = prev[1]["hidden_states"].shape[0]
                got_in, want_in = prev
            else:
                n = step if step != "feed" else 5
                _, _, proxies = make_batch(MIDDLE, [n], 1, 3, seed=seed + i)
                got_in = want_in = proxies
            _, pos, _ = make_batch(MIDDLE, [n], 1, 3, seed=seed + i)
            ctx = make_forward_context([n], MIDDLE, range(module.start_layer, module.end_layer))
            with set_forward_context(ctx):
                got = compiled(None, pos, pp_proxy_tensors=got_in)
            with set_forward_context(ctx):
                want = module(None, pos, pp_proxy_tensors=want_in)
            _same(got, want, f"middle stage, call {i} ({step}) at {n} tokens")
            prev = (got, want)

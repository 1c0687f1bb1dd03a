"""``find_collectives``: collectives recorded with their group and verdict; token-local ones stay graphed.

The graphs are traced in this process over a one-rank gloo group (set up and torn down per test), so a
gather stacks one rank's rows; the two-rank semantics are checked in tests/runtime/test_tensor_parallel.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from fx_helpers import dynamo_graph, make_ctx, run_until

from ppcompile.analysis.node_facts import CAPTURE_UNSAFE, COLLECTIVE, PADDING_UNSAFE
from ppcompile.passes.check_padding_safety import check_padding_safety
from ppcompile.passes.find_declared_regions import find_declared_regions

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

W = torch.randn(8, 8)


@pytest.fixture(autouse=True)
def one_rank_group() -> Iterator[None]:
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def _passes(fn: object, *, upto: object = check_padding_safety,
            **options: object) -> tuple[torch.fx.GraphModule, object]:
    x = torch.randn(12, 8)
    torch._dynamo.mark_dynamic(x, 0)
    gm, example = dynamo_graph(fn, x, dynamic=False)  # runs fn once
    ctx = make_ctx(gm, example, capture_sizes=[8, 16], graph_mode="emulate", **options)
    calls = dict(CALLS)
    gm = run_until(gm, ctx, upto)  # type: ignore[arg-type]
    assert calls == CALLS, "a pass ran a declared collective op"
    return gm, ctx


def _facts(gm: torch.fx.GraphModule) -> dict[str, tuple[str, str | None, str | None]]:
    return {n.name: (c.op, c.group, c.unsafe) for n in gm.graph.nodes if (c := COLLECTIVE.get(n)) is not None}


def _unsafe(gm: torch.fx.GraphModule) -> dict[str, str]:
    return {n.name: r for n in gm.graph.nodes if (r := PADDING_UNSAFE.get(n)) is not None}


def row_parallel(x: torch.Tensor) -> torch.Tensor:
    y = x @ W
    dist.all_reduce(y)
    return funcol.all_reduce(torch.relu(y), "sum", dist.group.WORLD) + 1


def test_all_reduces_are_recorded_with_their_group_and_stay_token_local() -> None:
    gm, ctx = _passes(row_parallel)
    facts = _facts(gm)
    group = dist.group.WORLD.group_name
    ops = sorted(op for op, _, _ in facts.values())
    assert ops == ["all_reduce", "all_reduce", "wait_tensor", "wait_tensor"]
    assert {g for _, g, _ in facts.values()} == {group}
    assert all(unsafe is None for _, _, unsafe in facts.values())
    assert [c.op for c in ctx.collectives] == ["all_reduce", "all_reduce"]  # type: ignore[attr-defined]
    assert _unsafe(gm) == {}


def gather_features(x: torch.Tensor) -> torch.Tensor:
    """A gather along the last dim, written as a gather along dim 0 and chunk + cat (what torch 2.13's
    ``all_gather_tensor(x, -1, group)`` traces to; 2.11's does not trace)."""
    logits = x @ W
    stacked = funcol.wait_tensor(funcol.all_gather_tensor(logits, 0, dist.group.WORLD))
    return torch.cat(torch.chunk(stacked, dist.get_world_size(), dim=0), dim=-1) * 2


def scatter_features(x: torch.Tensor) -> torch.Tensor:
    return funcol.reduce_scatter_tensor(x @ W, "sum", 1, dist.group.WORLD) + 1


@pytest.mark.parametrize(("fn", "label"), [(gather_features, "all_gather along dim 1"),
                                           (scatter_features, "reduce_scatter along dim 1")])
def test_a_gather_or_scatter_along_features_is_judged_with_its_chunk_and_cat(fn: object, label: str) -> None:
    gm, ctx = _passes(fn)
    facts = _facts(gm)
    ops = {op for op, _, _ in facts.values()}
    assert label in ops
    kinds = {n.target.__name__ if callable(n.target) else str(n.target)
             for n in gm.graph.nodes if COLLECTIVE.has(n)}
    assert {"chunk", "cat", "getitem"} <= kinds  # the round trip through dim 0 shares the verdict
    assert _unsafe(gm) == {}
    assert [c.op for c in ctx.collectives] == [label]  # type: ignore[attr-defined]


def gather_tokens(x: torch.Tensor) -> torch.Tensor:
    return funcol.all_gather_tensor(x @ W, 0, dist.group.WORLD) + 1


def scatter_tokens(x: torch.Tensor) -> torch.Tensor:
    return funcol.reduce_scatter_tensor(x @ W, "sum", 0, dist.group.WORLD) + 1


def exchange_tokens(x: torch.Tensor) -> torch.Tensor:
    return funcol.all_to_all_single(x @ W, None, None, dist.group.WORLD) + 1


@pytest.mark.parametrize(("fn", "words"), [
    (gather_tokens, "stacks every rank's rows along dim 0, a token dim"),
    (scatter_tokens, "splits the token dim between ranks"),
    (exchange_tokens, "exchanges token rows between ranks"),
])
def test_collectives_along_the_token_dim_are_breaks_naming_why(fn: object, words: str) -> None:
    gm, _ = _passes(fn)
    unsafe = _unsafe(gm)
    assert any(words in reason for reason in unsafe.values()), unsafe
    waits = [r for name, r in unsafe.items() if name.startswith("res") or "wait" in name]
    assert all("waits for" in r for r in waits if words not in r), unsafe  # its wait breaks with it


def test_without_the_pass_collectives_are_unknown_ops() -> None:
    """The verdicts come from find_collectives: a graph it has not seen breaks at every collective."""
    x = torch.randn(12, 8)
    torch._dynamo.mark_dynamic(x, 0)
    gm, example = dynamo_graph(row_parallel, x, dynamic=False)
    ctx = make_ctx(gm, example, capture_sizes=[8, 16], graph_mode="emulate")
    gm = run_until(gm, ctx, find_declared_regions)  # the pass before find_collectives
    check_padding_safety(gm, ctx)
    assert any("not known to be token-local" in r for r in _unsafe(gm).values())


CALLS = {"declared_all_reduce": 0}


@torch.library.custom_op("pptest::declared_all_reduce", mutates_args=())
def declared_all_reduce(x: torch.Tensor) -> torch.Tensor:
    CALLS["declared_all_reduce"] += 1  # a real one would communicate: the passes must never run it
    return x.clone()


@declared_all_reduce.register_fake
def _declared_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def engine_style(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.pptest.declared_all_reduce(x @ W) + 1


def test_declared_collective_ops_stay_graphed_and_are_never_probed() -> None:
    from ppcompile.passes.check_capture_safety import check_capture_safety

    gm, _ = _passes(engine_style, upto=check_capture_safety, collective_ops=["pptest::declared_all_reduce"])
    assert _facts(gm) == {"declared_all_reduce": ("pptest.declared_all_reduce", None, None)}
    assert _unsafe(gm) == {}
    assert not any(CAPTURE_UNSAFE.has(n) for n in gm.graph.nodes)
    undeclared, _ = _passes(engine_style)
    assert _unsafe(undeclared)  # without the option: an unknown op, a break

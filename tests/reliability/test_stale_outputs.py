"""No caller reads overwritten outputs (DESIGN invariant 4; docs/reliability.md, "Stale outputs").

By default (and with ``owned_outputs=True``) outputs are copies that survive any number of later calls.
With ``owned_outputs=False`` they are views valid until the next call, and ``debug=True`` checks that
contract: using an output after the next call of the same compiled stage instance raises
``StaleOutputError`` naming the output; views taken from it earlier read poison (NaN), never plausible
numbers. Valid outputs stay plain tensors, so the next compiled stage compiles exactly as without debug.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from reliability_helpers import (
    FeedbackStage,
    H,
    Stage,
    assert_matches,
    check,
    compile_stage,
    inputs,
    only_state,
    runtime,
)

from ppcompile import counters
from ppcompile.models import REFERENCE_CONFIGS, make_batch
from ppcompile.pipeline import InProcessPipeline
from ppcompile.runtime.stale_outputs import StaleOutput, StaleOutputError

VIEWS_DEBUG: dict[str, Any] = {"owned_outputs": False, "debug": True}  # the views contract, checked


def _owned_option(owned: bool | None) -> dict[str, Any]:
    return {} if owned is None else {"owned_outputs": owned}


def _static_storages() -> set[int]:
    rt = runtime()
    return {t.untyped_storage().data_ptr() for s in rt.instances() for t in s.static_tensors()}


def test_debug_stale_output_raises_naming_it() -> None:
    m = Stage()
    c = compile_stage(m, **VIEWS_DEBUG)
    with torch.no_grad():
        first, first2 = check(c, m, *inputs(5, seed=1))
        assert type(first) is torch.Tensor  # plain until it expires
        early_view = first[:2]
        check(c, m, *inputs(6, seed=2))
        assert isinstance(first, StaleOutput) and isinstance(first2, StaleOutput)
        pattern = (r"stale output 0 \(torch.float32, shape \[5, 8\]\) of call 1 of stage_graph_\S+ "
                   r"used after call 2.*clone\(\).*owned_outputs.*used by")
        with pytest.raises(StaleOutputError, match=pattern):
            _ = first + 0
        with pytest.raises(StaleOutputError, match="stale output 1"):
            torch.cat([first2])
        for use in (repr, lambda t: t.shape, lambda t: t.sum().item(), lambda t: t.clone()):
            with pytest.raises(StaleOutputError):
                use(first)
        assert torch.isnan(early_view).all(), "a view taken earlier must read poison, not old numbers"


def test_debug_outputs_of_the_latest_call_are_valid_and_match_eager() -> None:
    m = Stage()
    c = compile_stage(m, **VIEWS_DEBUG)
    with torch.no_grad():
        for i, n in enumerate([5, 8, 3, 16, 9, 17, 2]):
            got = check(c, m, *inputs(n, seed=i))
            assert all(type(t) is torch.Tensor for t in got)
        static = _static_storages()
        assert all(t.untyped_storage().data_ptr() not in static for t in got)


def test_debug_an_eager_call_also_expires_the_previous_outputs() -> None:
    m = Stage()
    c = compile_stage(m, **VIEWS_DEBUG)
    with torch.no_grad():
        first, _ = check(c, m, *inputs(5))
        with counters.expect(eager_runs=1, replays=0):
            above_cap, _ = check(c, m, *inputs(17))
        with pytest.raises(StaleOutputError):
            _ = first * 2
        check(c, m, *inputs(6))
        assert type(above_cap) is torch.Tensor  # eager outputs are fresh tensors: nothing to expire


def test_debug_integer_outputs_are_poisoned_with_the_minimum() -> None:
    class IntStage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(H, H)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = torch.ops.pptest_rel.mixer(self.lin(x))
            return h, (self.lin(h) * 100).to(torch.int32)

    m = IntStage()
    c = compile_stage(m, **VIEWS_DEBUG)
    with torch.no_grad():
        _, ints = c(torch.randn(5, H))
        view = ints[1:3]
        c(torch.randn(5, H))
        assert (view == torch.iinfo(torch.int32).min).all()


def test_debug_two_instances_expire_independently() -> None:
    m1, m2 = Stage(seed=1), Stage(seed=2)
    c1, c2 = compile_stage(m1, **VIEWS_DEBUG), compile_stage(m2, **VIEWS_DEBUG)
    with torch.no_grad():
        a, _ = check(c1, m1, *inputs(5))
        b, _ = check(c2, m2, *inputs(5))
        check(c2, m2, *inputs(6))  # instance 2's next call: a stays valid
        assert counters.backend_compiles == 1 and len(runtime().instances()) == 2
        torch.testing.assert_close(a, m1(*inputs(5))[0])
        with pytest.raises(StaleOutputError):
            _ = b + 0


def test_debug_an_output_fed_into_the_next_call_is_read_before_it_expires() -> None:
    m = FeedbackStage()
    c = compile_stage(m, **VIEWS_DEBUG)
    with torch.no_grad():
        x = torch.randn(6, H)
        for _ in range(3):
            want = m(x)
            got = c(x)  # x is an output of the previous call: it expires when this call ends
            assert_matches(got, want)
            x = got[1]
        with pytest.raises(StaleOutputError):
            c(torch.randn(6, H))
            _ = x + 0


def test_debug_a_stale_output_passed_to_another_compiled_stage_raises() -> None:
    m, nxt = Stage(seed=1), Stage(seed=2)
    c, cn = compile_stage(m, **VIEWS_DEBUG), compile_stage(nxt, **VIEWS_DEBUG)
    with torch.no_grad():
        out, res = c(*inputs(5))
        check(cn, nxt, out, res)  # valid: plain tensors
        c(*inputs(5, seed=1))
        with pytest.raises(Exception, match="stale output 0"):
            cn(out, res)


def test_debug_does_not_change_how_the_next_stage_compiles() -> None:
    """A PP4 pipeline compiles the same graphs with and without debug: same backend compiles, no graph
    breaks, same paths; debug only adds copies and the expiry."""
    cfg = REFERENCE_CONFIGS["tiny"]
    eager = InProcessPipeline(cfg, 4, compiled=False)
    seen: list[tuple[int, int, int]] = []
    for debug in (False, True):
        torch._dynamo.reset()
        counters.reset()
        torch._dynamo.utils.counters.clear()
        options = {"capture_sizes": [4, 8, 16], "graph_mode": "emulate", "debug": debug}
        graphed = InProcessPipeline(cfg, 4, compiled=True, options=options)
        with torch.inference_mode():
            for i, n in enumerate([5, 9, 16, 3, 20, 7]):
                ids, pos, _ = make_batch(cfg, [n], 0, 4, seed=i)
                torch.testing.assert_close(graphed(ids, pos, [n]), eager(ids, pos, [n]))
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        seen.append((counters.backend_compiles, counters.replays, breaks))
    assert seen[0] == seen[1] and seen[0][2] == 0, seen


def test_views_without_debug_are_static_memory_and_nothing_is_tracked() -> None:
    m = Stage()
    c = compile_stage(m, owned_outputs=False)
    with torch.no_grad():
        first, _ = check(c, m, *inputs(5))
        assert first.untyped_storage().data_ptr() in _static_storages()
        check(c, m, *inputs(6))
    rt = runtime()
    assert only_state(rt).tracker is None
    assert type(first) is torch.Tensor


@pytest.mark.parametrize("owned", [True, None], ids=["owned", "default"])
@pytest.mark.parametrize("debug", [False, True])
def test_owned_outputs_are_copies_that_survive_later_calls(debug: bool, owned: bool | None) -> None:
    m = Stage()
    c = compile_stage(m, debug=debug, **_owned_option(owned))
    with torch.no_grad():
        kept: list[tuple[tuple[torch.Tensor, ...], tuple[Any, ...]]] = []
        for i, n in enumerate([5, 8, 6, 12, 16, 5]):
            got = check(c, m, *inputs(n, seed=i))
            kept.append((got, tuple(t.clone() for t in got)))
        static = _static_storages()
        for got, copy in kept:
            for g, k in zip(got, copy):
                assert type(g) is torch.Tensor and torch.equal(g, k)
                assert g.untyped_storage().data_ptr() not in static


class BreakViewStage(torch.nn.Module):
    """Its output is made by a break op (``torch.t`` listed in ``split_ops``) as a view of a graph
    output, i.e. of static memory, although it is not a graph output itself."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.t(self.lin(x))


@pytest.mark.parametrize("owned", [True, None], ids=["owned", "default"])
@pytest.mark.parametrize("debug", [False, True])
def test_owned_outputs_copy_a_break_ops_view_of_static_memory(debug: bool, owned: bool | None) -> None:
    m = BreakViewStage()
    c = compile_stage(m, debug=debug, split_ops=[torch.t], **_owned_option(owned))
    with torch.no_grad():
        first = c(torch.randn(5, H))
        kept = first.clone()
        c(torch.randn(5, H))
        assert counters.replays == 2
        assert torch.equal(first, kept)


def test_debug_tracks_a_break_ops_view_of_static_memory() -> None:
    m = BreakViewStage()
    c = compile_stage(m, **VIEWS_DEBUG, split_ops=[torch.t])
    with torch.no_grad():
        x = torch.randn(5, H)
        first = c(x)
        torch.testing.assert_close(first, m(x))
        c(torch.randn(5, H))
        with pytest.raises(StaleOutputError, match="stale output 0"):
            _ = first + 0

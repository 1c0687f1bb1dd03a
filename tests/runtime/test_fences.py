"""``ppcompile.fence_outputs``: an engine's PP loop hands the stage the fence of each asynchronous send of
its outputs, and the stage waits for it before it writes that ring slot again, so sends need no copies
and the loop never waits itself. Checked with emulated lazy sends (a send reads its tensor only when it
is waited, as gloo does when the receiver posts late)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from hand_made_stage import CAP, H, eager, hand_made
from hypothesis import given, settings
from hypothesis import strategies as st

import ppcompile
from ppcompile.runtime.stage_runtime import StageRuntime


class LazySend:
    """A send that reads its tensor when waited (at the latest), like a gloo send to a late receiver."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t: torch.Tensor | None = t
        self.received: torch.Tensor | None = None
        self.waits = 0

    def wait(self) -> bool:
        self.waits += 1
        if self.t is not None:
            self.received, self.t = self.t.clone(), None
        return True


def _loop(runtime: StageRuntime, counts: list[int], fence: bool, delay: int = 10**9) -> list[bool]:
    """An engine loop: runs a forward per count, starts a lazy send of each output (fenced or not) and
    completes sends only ``delay`` forwards later (or at the end); returns per forward whether what
    was received equals eager's answer."""
    w = torch.randn(H, H, generator=torch.Generator().manual_seed(99))
    sends: list[tuple[LazySend, torch.Tensor]] = []
    with torch.no_grad():
        for i, n in enumerate(counts):
            x = torch.randn(n, H, generator=torch.Generator().manual_seed(i))
            out = runtime(x, w)
            send = LazySend(out[0])
            if fence:
                ppcompile.fence_outputs(out, send)
            sends.append((send, eager(x, w)))
            if i >= delay:
                sends[i - delay][0].wait()
    for send, _ in sends:
        send.wait()
    return [s.received is not None and torch.allclose(s.received, want, atol=1e-5) for s, want in sends]


COUNTS = st.lists(st.integers(1, CAP + 3), min_size=1, max_size=12)  # crossing buckets, above the cap


@settings(max_examples=150, deadline=None)
@given(counts=COUNTS, slots=st.integers(2, 4))
def test_fenced_sends_read_the_right_outputs_however_late_they_complete(counts: list[int],
                                                                       slots: int) -> None:
    assert all(_loop(StageRuntime(*hand_made(output_slots=slots)), counts, fence=True))


def test_without_the_fence_late_sends_read_overwritten_slots() -> None:
    """The fence has teeth: the same loop without it receives wrong rows for every forward whose slot
    was reused before its send completed."""
    counts = [5, 6, 7, 12, 9, 5, 3, 16]
    ok = _loop(StageRuntime(*hand_made(output_slots=2)), counts, fence=False)
    assert ok[-2:] == [True, True] and not any(ok[:-2]), ok  # only the last two slots were never reused
    assert all(_loop(StageRuntime(*hand_made(output_slots=2)), counts, fence=True))


def test_a_slot_waits_its_fences_once_and_only_when_reused() -> None:
    runtime = StageRuntime(*hand_made(output_slots=2))
    w = torch.ones(H, H)
    sends = []
    with torch.no_grad(), ppcompile.counters.expect(fence_waits={"work": 3}):
        for n in (5, 9, 16, 3, 7):
            out = runtime(torch.randn(n, H), w)
            sends.append(LazySend(out[0]))
            assert ppcompile.fence_outputs(out, sends[-1]) == 1
        # forwards 3, 4 and 5 reused the slots of forwards 1, 2 and 3; 4 and 5 are still unwaited
        assert [s.waits for s in sends] == [1, 1, 1, 0, 0]


def test_eager_path_outputs_and_a_stage_without_a_ring_have_nothing_to_fence() -> None:
    w = torch.ones(H, H)
    with torch.no_grad():
        above_cap = StageRuntime(*hand_made(output_slots=2))(torch.randn(CAP + 1, H), w)
        no_ring = StageRuntime(*hand_made())(torch.randn(5, H), w)
    assert ppcompile.fence_outputs(above_cap, LazySend(above_cap[0])) == 0  # fresh tensors
    assert ppcompile.fence_outputs(no_ring, LazySend(no_ring[0])) == 0
    assert ppcompile.fence_outputs(torch.zeros(3), lambda: None) == 0


def test_fences_must_be_events_works_or_callables() -> None:
    out = torch.zeros(2)
    with pytest.raises(ValueError, match="at least one fence"):
        ppcompile.fence_outputs(out)
    with pytest.raises(TypeError, match="got int"):
        ppcompile.fence_outputs(out, 3)


def test_a_callable_fence_is_called_before_the_slot_is_written() -> None:
    """The fence runs inside forward i + k, after its segments and before its ring copy."""
    runtime = StageRuntime(*hand_made(output_slots=2))
    w = torch.ones(H, H)
    seen: list[Any] = []
    with torch.no_grad():
        first = runtime(torch.randn(5, H), w)
        kept = first[0].clone()
        ppcompile.fence_outputs(first, lambda: seen.append(torch.equal(first[0], kept)))
        runtime(torch.randn(6, H), w)
        assert seen == []
        runtime(torch.randn(7, H), w)  # reuses forward 1's slot
    assert seen == [True]  # the slot still held forward 1's outputs when the fence ran


def test_random_engine_loop_with_two_slots_and_sends_completing_in_any_order() -> None:
    """10,000 forwards; each forward's send completes 0 or 1 forwards later (drawn), or is left for the
    stage to wait at slot reuse."""
    rng = random.Random(0)
    runtime = StageRuntime(*hand_made(output_slots=2))
    w = torch.randn(H, H, generator=torch.Generator().manual_seed(1))
    open_sends: list[tuple[LazySend, torch.Tensor]] = []
    with torch.no_grad():
        for i in range(10_000):
            n = rng.randint(1, CAP + 3)
            x = torch.randn(n, H, generator=torch.Generator().manual_seed(i))
            out = runtime(x, w)
            send = LazySend(out[0])
            ppcompile.fence_outputs(out, send)
            open_sends.append((send, eager(x, w)))
            for s, _ in [o for o in open_sends if rng.random() < 0.5]:
                s.wait()
            done = [o for o in open_sends if o[0].received is not None]
            for s, want in done:
                torch.testing.assert_close(s.received, want, atol=1e-5, rtol=1e-5)
            open_sends = [o for o in open_sends if o[0].received is None]

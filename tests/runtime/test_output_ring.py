"""``output_slots=k``: the outputs of forward i stay valid until forward i + k starts, whatever the token
counts (a ring of k output slots, ``Program.output_ring``), checked with an emulated delayed reader: a
PP loop that reads (sends) each forward's outputs only after j later forwards have run."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from hand_made_stage import CAP, H, eager, hand_made
from hypothesis import given, settings
from hypothesis import strategies as st
from mixer_stage import MixerStage, register_mixer

import ppcompile
from ppcompile.models.layers import fused_add_rms_norm
from ppcompile.runtime.stage_runtime import StageRuntime
from ppcompile.runtime.stale_outputs import StaleOutputError

COUNTS = st.integers(min_value=1, max_value=CAP + 3)  # up to above the cap (eager there)
RING_MIXER = register_mixer("pptest_ring::mixer", lambda x: None)


def _runtime(slots: int, **options: Any) -> StageRuntime:
    return StageRuntime(*hand_made(output_slots=slots, **options))


def _delayed_reads_wrong(runtime: StageRuntime, counts: list[int], delay: int, w: torch.Tensor) -> int:
    """Runs a forward per count; reads each forward's output ``delay`` forwards later and compares it
    with eager's. Returns how many reads were wrong."""
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    wrong = 0
    with torch.no_grad():
        for i, n in enumerate(counts):
            x = torch.randn(n, H, generator=torch.Generator().manual_seed(i))
            pending.append((runtime(x, w)[0], eager(x, w)))
            if len(pending) > delay:
                got, want = pending.pop(0)
                wrong += not torch.allclose(got, want, atol=1e-5)
    return wrong


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(COUNTS, min_size=1, max_size=12), slots=st.integers(2, 4), data=st.data())
def test_a_reader_delayed_less_than_the_ring_always_reads_the_right_outputs(
    counts: list[int], slots: int, data: st.DataObject
) -> None:
    delay = data.draw(st.integers(0, slots - 1))
    assert _delayed_reads_wrong(_runtime(slots), counts, delay, torch.ones(H, H)) == 0


def test_ten_thousand_random_interleavings_with_two_slots() -> None:
    """One long run: random token counts and a reader delayed 0 or 1 forwards, drawn per forward."""
    rng = random.Random(0)
    runtime = _runtime(2)
    w = torch.randn(H, H, generator=torch.Generator().manual_seed(1))
    held: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (forward, output, eager's)
    with torch.no_grad():
        for i in range(10_000):
            n = rng.randint(1, CAP + 3)
            x = torch.randn(n, H, generator=torch.Generator().manual_seed(i))
            held.append((i, runtime(x, w)[0], eager(x, w)))
            held = [h for h in held if h[0] > i - 2]  # forward i - 1's outputs stay valid until i + 1
            read = held[rng.randrange(len(held))]
            torch.testing.assert_close(read[1], read[2], atol=1e-5, rtol=1e-5)


def test_one_slot_is_flagged_by_a_reader_one_forward_late() -> None:
    """What the ring prevents: with views into graph memory (k=1, ``owned_outputs=False``) the output of
    forward i read after forward i + 1 has its rows overwritten; the default (owned copies) never is."""
    counts = [5, 6, 7, 12, 9, 5]
    assert _delayed_reads_wrong(_runtime(1, owned_outputs=False), counts, 1, torch.ones(H, H)) > 0
    assert _delayed_reads_wrong(_runtime(2), counts, 1, torch.ones(H, H)) == 0
    assert _delayed_reads_wrong(_runtime(1), counts, 1, torch.ones(H, H)) == 0


def test_the_ring_costs_one_copy_of_the_outputs_per_slot_and_one_output_copy_per_forward() -> None:
    counts: dict[str, int] = {}

    def count(category: str, fn: Any) -> Any:
        def counted(*args: Any) -> Any:
            counts[category] = counts.get(category, 0) + 1
            return fn(*args)

        return counted

    plain, ringed = _runtime(1), _runtime(3)
    w = torch.ones(H, H)
    with torch.no_grad():
        for rt in (plain, ringed):
            rt(torch.randn(5, H), w)  # captures
        with ringed.instrumented(count):
            for n in (5, 9, 16):
                ringed(torch.randn(n, H), w)
    assert counts["output copies"] == 3  # one output in static memory, one copy per forward
    (ring,) = ringed.instances()
    assert ringed.static_bytes() - plain.static_bytes() == 3 * CAP * H * 4  # 3 slots of [16, 4] fp32
    assert ring.ring is not None and len(ring.ring.slots) == 3


def test_in_debug_mode_an_output_expires_when_its_slot_is_reused() -> None:
    runtime = _runtime(2, debug=True)
    w = torch.ones(H, H)
    with torch.no_grad():
        first = runtime(torch.randn(5, H), w)[0]
        second = runtime(torch.randn(6, H), w)[0]
        first.sum()  # forward 1's output is valid until forward 3 starts
        runtime(torch.randn(7, H), w)
        second.sum()
        with pytest.raises(StaleOutputError, match="valid for 2 calls"):
            first.sum()


def test_a_compiled_stage_keeps_two_forwards_of_outputs_with_two_slots() -> None:
    """Through torch.compile: a graph | break | graph stage, the outputs of each forward read one
    forward late, at 1, a bucket, a bucket + 1 and above the cap."""
    m = MixerStage(RING_MIXER, H)
    c = torch.compile(m, backend="pp_breakable", options={
        "graph_mode": "emulate", "capture_sizes": [4, 8, CAP], "output_slots": 2})
    pending: list[tuple[Any, Any]] = []
    with torch.no_grad(), ppcompile.counters.expect(replays=6, eager_runs=1):  # 17 is above the cap
        for i, n in enumerate([3, 8, 9, 16, 17, 5, 6]):
            g = torch.Generator().manual_seed(i)
            x, r = torch.randn(n, H, generator=g), torch.randn(n, H, generator=g)
            ppcompile.mark_token_dynamic(x, r)
            pending.append((c(x, r), m(x, r)))
            if len(pending) > 1:
                for got, want in zip(*pending.pop(0)):
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_report_shows_the_ring() -> None:
    from ppcompile.debug.report import build_report

    runtime = _runtime(2)
    assert build_report(_runtime(1))["output_ring"] is None
    assert build_report(runtime)["output_ring"]["bytes_per_slot"] is None  # no instance yet
    with torch.no_grad():
        runtime(torch.randn(5, H), torch.ones(H, H))
    ring = build_report(runtime)["output_ring"]
    assert ring == {"slots": 2, "outputs": ["g2[0]"], "bytes_per_slot": CAP * H * 4, "copies_per_forward": 1}


class WritesItsInput(torch.nn.Module):
    """A non-first PP stage's first layer as vLLM writes it: ``fused_add_rms_norm(x, residual)`` (a
    token-local op writing both inputs in a graph, that is their static buffers) | break (mixer) |
    graph; returns the written residual too, so an output in the ring is a static input buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(H, H), torch.nn.Linear(H, H)
        self.weight = torch.nn.Parameter(torch.ones(H))

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fused_add_rms_norm(x, residual, self.weight, 1e-6)
        return self.down(RING_MIXER(self.up(x))) + residual, residual


def test_an_input_a_graph_writes_and_the_stage_returns_stays_right_with_a_ring() -> None:
    """Dynamo returns an input it hands back itself (the caller's tensor, which the graph path updates
    at the end of the call), so only the graph output goes into the ring; both read one forward late
    equal eager's."""
    m = WritesItsInput()
    c = torch.compile(m, backend="pp_breakable", options={
        "graph_mode": "emulate", "capture_sizes": [4, 8, CAP], "output_slots": 2})
    pending: list[tuple[Any, Any]] = []
    with torch.no_grad():
        for i, n in enumerate([5, 8, 12, 6]):
            g = torch.Generator().manual_seed(i)
            x, r = torch.randn(n, H, generator=g), torch.randn(n, H, generator=g)
            mine, theirs = (x.clone(), r.clone()), (x.clone(), r.clone())
            ppcompile.mark_token_dynamic(*mine)
            pending.append((c(*mine), m(*theirs)))
            if len(pending) > 1:
                for got, want in zip(*pending.pop(0)):
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    (runtime,) = [rt for rt in ppcompile.runtimes_of(m) if rt.token_symbol is not None]
    ring = runtime.program.output_ring
    assert ring is not None and len(ring.slots) == 1 and runtime.program.written_inputs


class FeatureMajorOutput(torch.nn.Module):
    """graph | break | graph whose second output is feature-major, ``[H, T]`` contiguous (token dim 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = MixerStage(RING_MIXER, H)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, summed = self.inner(x, r)
        return out, (summed * 3).t().contiguous()


def test_a_feature_major_output_keeps_eager_strides_in_the_ring() -> None:
    """A ring slot is flat memory viewed with the output's live shape and eager's strides, so an output
    whose token dim is not dim 0 is contiguous at every count, not strided for the cap."""
    m = FeatureMajorOutput()
    c = torch.compile(m, backend="pp_breakable", options={
        "graph_mode": "emulate", "capture_sizes": [4, 8, CAP], "output_slots": 2})
    pending: list[tuple[Any, Any]] = []
    with torch.no_grad(), ppcompile.counters.expect(replays=5, eager_runs=1):
        for i, n in enumerate([3, 8, 9, 16, 17, 5]):
            g = torch.Generator().manual_seed(i)
            x, r = torch.randn(n, H, generator=g), torch.randn(n, H, generator=g)
            ppcompile.mark_token_dynamic(x, r)
            got, want = c(x, r), m(x, r)
            assert got[1].shape == (H, n) and got[1].stride() == want[1].stride() == (n, 1)
            pending.append((got, want))
            if len(pending) > 1:
                for g_, w_ in zip(*pending.pop(0)):
                    torch.testing.assert_close(g_, w_, atol=1e-5, rtol=1e-5)
    (runtime,) = [rt for rt in ppcompile.runtimes_of(m) if rt.token_symbol is not None]
    ring = runtime.program.output_ring
    assert ring is not None and len(ring.slots) == 2

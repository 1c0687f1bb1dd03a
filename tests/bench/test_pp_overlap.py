"""The simulated PP schedule (``bench/pp_overlap.py``): hand-computed schedules, the properties the model
must keep, input validation, and a smoke run of the benchmark. No timing asserts: the simulator is pure."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ppcompile.cli import bench as bench_cli

pp_overlap = bench_cli._bench("pp_overlap")
simulate = pp_overlap.simulate
MODES = pp_overlap.MODES


def _random_case(rng: random.Random) -> tuple[list[float], float, float, int]:
    stages, micro_batches = rng.randint(1, 5), rng.randint(1, 8)
    return [rng.uniform(0.0, 5.0) for _ in range(stages)], rng.uniform(0.0, 4.0), rng.uniform(0.0, 4.0), \
        micro_batches


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_free_transfers_give_the_classic_pipeline_makespan(mode: str, depth: int) -> None:
    assert simulate([2.0] * 4, 0.0, 0.0, 5, 8, mode, depth).makespan_s == 4 * 2.0 + 4 * 2.0
    rng = random.Random(depth)
    for _ in range(50):  # unequal stages too: sum(F) + (M - 1) max(F)
        forward, _, _, m = _random_case(rng)
        want = sum(forward) + (m - 1) * max(forward)
        assert simulate(forward, 0.0, 0.0, m, 8, mode, depth).makespan_s == pytest.approx(want)


# S=2, F=[2, 3], C=1, K=0.5, M=3, worked by hand. wait at depth 1: stage 0 forwards 0-2, 3.5-5.5, 7.5-9.5
# (each after the previous transfer), packs to 2.5, 6, 10; transfers 2.5-3.5, 6.5-7.5, 10.5-11.5 (each
# waits for stage 1's previous forward to post its receive); stage 1 runs 3.5-6.5, 7.5-10.5, 11.5-14.5.
# wait at depth 2: transfer 1 at 6-7 (its receive was posted at 0), stage 1 ends at 13.5.
# ring at depth 2: packs end 2.5, 5, 7.5; transfers 2.5-3.5, 5-6, 7.5-8.5; stage 1 runs 3.5-6.5,
# 6.5-9.5, 9.5-12.5. copy schedules as ring does.
HAND = [("wait", 1, 14.5), ("wait", 2, 13.5), ("copy", 1, 14.5), ("copy", 2, 12.5), ("ring", 1, 14.5),
        ("ring", 2, 12.5)]


@pytest.mark.parametrize(("mode", "depth", "makespan"), HAND)
def test_two_stages_three_micro_batches_by_hand(mode: str, depth: int, makespan: float) -> None:
    assert simulate([2.0, 3.0], 1.0, 0.5, 3, 10, mode, depth).makespan_s == pytest.approx(makespan)


def test_bubble_tokens_and_busy_of_a_hand_schedule() -> None:
    got = simulate([2.0, 3.0], 1.0, 0.5, 3, 10, "copy", 2)
    assert (got.mode, got.depth, got.busy_s) == ("copy", 2, (7.5, 9.0))  # forwards plus packs
    assert got.bubble_fraction == pytest.approx(1 - 15 / 25)  # 1 - M sum(F) / (S makespan)
    assert got.tokens_per_s == pytest.approx(30 / 12.5)
    assert simulate([2.0, 3.0], 1.0, 0.5, 3, 10, "wait", 2).busy_s == (7.5, 9.0)  # every mode packs


def test_the_ring_stalls_on_a_slot_still_on_the_wire() -> None:
    """S=2, F=[1, 1], C=3, K=4, M=2, depth 1. ring: pack 1-5, transfer 5-8; forward 1 at 1-2, then its
    pack waits for transfer 0 (ends 8) into the one buffer, runs 8-12, transfer 12-15, the last forward
    15-16. wait: forward 1 itself waits for transfer 0: 8-9, pack 9-13, transfer 13-16, the last 16-17.
    At depth 2 the second pack has a buffer of its own: pack 6-10 right after forward 1 ... 14."""
    assert simulate([1.0, 1.0], 3.0, 4.0, 2, 1, "ring", 1).makespan_s == pytest.approx(16.0)
    assert simulate([1.0, 1.0], 3.0, 4.0, 2, 1, "wait", 1).makespan_s == pytest.approx(17.0)
    assert simulate([1.0, 1.0], 3.0, 4.0, 2, 1, "ring", 2).makespan_s == pytest.approx(14.0)


def _makespan(case: tuple[list[float], float, float, int], mode: str, depth: int,
              pack: float | None = None) -> float:
    forward, send, default_pack, micro_batches = case
    k = default_pack if pack is None else pack
    return float(simulate(forward, send, k, micro_batches, 1, mode, depth).makespan_s)


def test_ring_equals_copy_beats_wait_and_deeper_is_no_worse() -> None:
    rng = random.Random(0)
    for _ in range(200):
        case, depth = _random_case(rng), rng.randint(1, 3)
        assert _makespan(case, "ring", depth) <= _makespan(case, "wait", depth) + 1e-9
        assert _makespan(case, "copy", depth) == _makespan(case, "ring", depth)  # the same waits
        for mode in MODES:
            assert _makespan(case, mode, depth + 1) <= _makespan(case, mode, depth) + 1e-9


def test_simulate_is_deterministic_and_one_stage_has_no_bubble() -> None:
    args = ([1.5, 2.5, 0.5], 0.7, 0.2, 6, 32, "ring", 2)
    assert simulate(*args) == simulate(*args)
    alone = simulate([2.0], 5.0, 5.0, 4, 16, "ring", 1)  # the last stage sends nothing
    assert (alone.makespan_s, alone.bubble_fraction, alone.busy_s) == (8.0, 0.0, (8.0,))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"forward_s": []}, "S >= 1"),
    ({"micro_batches": 0}, "micro_batches must be an int >= 1"),
    ({"tokens": 0}, "tokens must be an int >= 1"),
    ({"depth": 0}, "depth must be an int >= 1"),
    ({"mode": "nccl"}, "mode must be one of"),
    ({"forward_s": [1.0, -1.0]}, r"forward_s\[1\] must be a finite number"),
    ({"send_s": -0.1}, "send_s must be"),
    ({"pack_s": float("nan")}, "pack_s must be"),
])
def test_bad_inputs_are_named(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"forward_s": [1.0, 1.0], "send_s": 0.1, "pack_s": 0.1, "micro_batches": 2,
                               "tokens": 4, "mode": "copy", "depth": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        simulate(**args)


def test_markdown_section_states_machine_inputs_and_target(tmp_path: Path) -> None:
    suite = pp_overlap.SUITES["tiny"]
    inputs = pp_overlap.Inputs((2e-3, 1e-3, 1e-3, 1e-3), 1e-4, 1e-5, 4096, ("hidden_states", "residual"))
    text = pp_overlap.markdown(inputs, suite, 8, pp_overlap.run(inputs, suite, 8), "a test box")
    assert "a test box" in text and "gloo over loopback" in text and "one run" in text
    assert text.count("| wait |") == 3 and text.count("| ring |") == 3 and "| x16 (1600 us) |" in text
    assert "Target (PP4, depth 2" in text
    doc = tmp_path / "benchmarks.md"
    bench_cli._bench("report").update_markdown_section(doc, "pp-overlap", text)
    assert "<!-- pp-overlap:start -->" in doc.read_text()


@pytest.mark.usefixtures("fresh_dynamo")
def test_bench_runs_the_tiny_suite(capsys: pytest.CaptureFixture[str]) -> None:
    assert pp_overlap.main(["--suite", "tiny", "--no-docs"]) == 0
    out = capsys.readouterr().out
    assert "| copy | 2 |" in out and "Send C = " in out and "wrote" not in out

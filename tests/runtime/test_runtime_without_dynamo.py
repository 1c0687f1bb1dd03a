"""A ``StageRuntime`` built from a hand-made ``CompiledStage``: runtime behaviour tested directly, with no
Dynamo trace and no passes (the plan written out as lowering would emit it).

The stage: ``graph (x @ w) | break (cumsum over tokens, bridged) | graph (* 2)``, token count ``s0``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
import sympy
import torch

import ppcompile
from ppcompile.config import PPBreakableConfig
from ppcompile.records import Segment, StaticBuffer
from ppcompile.runtime.buckets import make_bucket_plan
from ppcompile.runtime.compiled_stage import CompiledStage
from ppcompile.runtime.observer import BucketCapture, CaptureRecord, CaptureStart
from ppcompile.runtime.program import BreakStep, CopyPoint, GraphStep, Program, Ref
from ppcompile.runtime.stage_runtime import StageRuntime
from ppcompile.runtime.static_buffers import BufferPlan, TensorLayout
from ppcompile.runtime.validation import InputSpec
from ppcompile.symbolic import SizeFn

H, CAP = 4, 16
S0 = sympy.Symbol("s0", integer=True, positive=True)
TOKENS, WIDTH, ONE = SizeFn(S0), SizeFn(sympy.Integer(H)), SizeFn(sympy.Integer(1))
ROWS = ((0, TOKENS),)  # dim 0 scales with the token count
CPU = torch.device("cpu")
LAYOUT = TensorLayout((TOKENS, WIDTH), (WIDTH, ONE), torch.float32, CPU)


def _matmul(x: torch.Tensor, w: torch.Tensor) -> Sequence[torch.Tensor]:
    return (x @ w,)


def _cumsum(h: torch.Tensor) -> Sequence[torch.Tensor]:
    return (h.cumsum(0),)


def _double(c: torch.Tensor) -> Sequence[torch.Tensor]:
    return (c * 2,)


def _compiled(mode: str = "emulate", bridge: bool = True) -> tuple[CompiledStage, PPBreakableConfig]:
    """Slots: 0 x (live input), 1 w (module state), 2 x @ w, 3 its cumsum (bridged), 4 the output.
    ``bridge=False``: the break's copy point is left out (a lowering bug)."""
    config = PPBreakableConfig.from_options({"graph_mode": mode, "capture_sizes": [4, 8, CAP]})
    graph_0, brk, graph_2 = Segment("g0", "graph", 1), Segment("b1", "break", 1), Segment("g2", "graph", 1)
    sized = {"out_sizes": ((TOKENS, WIDTH),), "out_layouts": (LAYOUT,)}
    buffers = {
        0: BufferPlan(0, StaticBuffer("x", "input", (CAP, H), torch.float32, CPU, (0,)), "input 'x'", ROWS),
        3: BufferPlan(3, StaticBuffer("b1", "bridge", (CAP, H), torch.float32, CPU, (0,)),
                      "the output 0 of break segment b1", ROWS),
    }
    copies = CopyPoint(1, 1, (3,), (3,)) if bridge else None
    program = Program(
        num_slots=5, num_inputs=2,
        steps=(
            GraphStep(0, graph_0, _matmul, (Ref(slot=0), Ref(slot=1)), (2,), live_views=(2,), **sized),
            BreakStep(1, brk, _cumsum, (Ref(slot=2),), (3,), copies=copies, **sized),
            GraphStep(2, graph_2, _double, (Ref(slot=3),), (4,), live_views=(4,), **sized),
        ),
        outputs=(Ref(slot=4),),
        token_dims={slot: ROWS for slot in (0, 2, 3, 4)},
        buffers=buffers,
        copy_in=CopyPoint(0, None, (0,), (0,)),
        input_layouts={0: ("x", LAYOUT)},
    )
    compiled = CompiledStage(
        name="hand_made", graph_mode=mode, program=program, plan=make_bucket_plan(config),
        segments=(graph_0, brk, graph_2), layer_ids=(), token_symbol=S0, token_input=(0, 0),
        symbol_slots=(), state_slots=(1,), scalar_slots=(), tensor_slots=(0,),
        input_specs=(InputSpec(0, "x", torch.float32, CPU, 2, ((1, H),), ((0, TOKENS),)),),
        live_checks=(), eager_reason=None,
    )
    return compiled, config


def _eager(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w).cumsum(0) * 2


def _call(runtime: StageRuntime, n: int, w: torch.Tensor, seed: int) -> tuple[Any, torch.Tensor]:
    x = torch.randn(n, H, generator=torch.Generator().manual_seed(seed))
    return runtime(x, w)[0], _eager(x, w)


@pytest.mark.parametrize("mode", ["emulate", "eager"])
def test_a_hand_made_stage_serves_graphs_and_falls_back_above_the_cap(mode: str) -> None:
    runtime = StageRuntime(*_compiled(mode))
    w = torch.randn(H, H)
    # One token is beyond the padding guard (bucket 4 would pad it 4x): it runs eagerly, as 17 does.
    with torch.no_grad(), ppcompile.counters.expect(replays=3, eager_runs=2,
                                                    replays_by_bucket={4: 1, 8: 1, 16: 1}):
        for i, n in enumerate([1, 4, 5, 16, 17]):  # one token, a bucket, a bucket + 1, the cap, above
            got, want = _call(runtime, n, w, seed=i)
            torch.testing.assert_close(got, want)
    (instance,) = runtime.instances()
    assert instance.captured_buckets == (4, 8, 16)
    assert [tuple(b.shape) for b in instance.input_buffers.values()] == [(CAP, H)]
    assert list(instance.bridge_buffers) == [3]
    (code,) = [code for what, code in runtime.generated_code().items() if what.startswith("graph")]
    assert "copy_rows(static[0], v0" in code and "bridge_rows(static[3], v3" in code


def test_a_plan_without_the_bridge_copy_point_gives_wrong_answers_under_emulation() -> None:
    """The emulator's teeth, on the plan itself: the graph after the break reads a bridge nobody
    fills."""
    compiled, config = _compiled(bridge=False)
    runtime = StageRuntime(compiled, config)
    w = torch.randn(H, H)
    with torch.no_grad():
        got, want = _call(runtime, 5, w, seed=0)
    assert not torch.allclose(got, want)
    right = StageRuntime(dataclasses.replace(compiled, program=_compiled()[0].program), config)
    with torch.no_grad():
        got, want = _call(right, 5, w, seed=0)
    torch.testing.assert_close(got, want)


def test_an_observer_hears_each_capture_run_through_small_records() -> None:
    """The runtime measures its captures and keeps the records; an observer gets the start, each bucket
    and the end as records (never the runtime), also for a lazy run of one bucket."""
    heard: list[Any] = []

    class Run:
        def bucket_done(self, bucket: BucketCapture) -> None:
            heard.append(bucket)

        def ended(self, record: CaptureRecord) -> None:
            heard.append(record)

    def observer(start: CaptureStart) -> Run:
        heard.append(start)
        return Run()

    compiled, config = _compiled()
    runtime = StageRuntime(compiled, dataclasses.replace(config, capture="lazy"), observer=observer)
    w = torch.randn(H, H)
    with torch.no_grad():
        for i, n in enumerate([5, 6, 12]):  # bucket 8 captured at its first use, then reused; then 16
            _call(runtime, n, w, seed=i)
    start, bucket, record = heard[:3]
    assert start == CaptureStart("hand_made", "emulate", graphs_per_bucket=2, buckets=1)
    assert bucket.bucket == 8 and bucket.graphs == 2 and bucket.output_bytes > 0
    assert record.buckets == (bucket,) and record.failed is None and record.graphs == 2
    assert [type(e).__name__ for e in heard[3:]] == ["CaptureStart", "BucketCapture", "CaptureRecord"]
    assert runtime.capture_records() == [record, heard[-1]]

"""A ``StageRuntime`` built from a hand-made ``CompiledStage``: runtime behaviour tested directly, with no
Dynamo trace and no passes (the plan written out as lowering would emit it).

The stage: ``tests/runtime/hand_made_stage.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hand_made_stage import CAP, H, call, hand_made

import ppcompile
from ppcompile.runtime.observer import BucketCapture, CaptureRecord, CaptureStart
from ppcompile.runtime.stage_runtime import StageRuntime


@pytest.mark.parametrize("mode", ["emulate", "eager"])
def test_a_hand_made_stage_serves_graphs_and_falls_back_above_the_cap(mode: str) -> None:
    runtime = StageRuntime(*hand_made(mode))
    w = torch.randn(H, H)
    # One token is beyond the padding guard (bucket 4 would pad it 4x): it runs eagerly, as 17 does.
    with torch.no_grad(), ppcompile.counters.expect(replays=3, eager_runs=2,
                                                    replays_by_bucket={4: 1, 8: 1, 16: 1}):
        for i, n in enumerate([1, 4, 5, 16, 17]):  # one token, a bucket, a bucket + 1, the cap, above
            got, want = call(runtime, n, w, seed=i)
            torch.testing.assert_close(got, want)
    (instance,) = runtime.instances()
    assert instance.captured_buckets == (4, 8, 16)
    assert [tuple(b.shape) for b in instance.input_buffers.values()] == [(CAP, H)]
    assert list(instance.bridge_buffers) == [3]
    (code,) = [code for what, code in runtime.generated_code().items() if what.startswith("graph")]
    assert "dst0.copy_(v0)" in code and "dst3.copy_(v3)" in code  # copy-in, and the bridge after the break


def test_a_plan_without_the_bridge_copy_point_gives_wrong_answers_under_emulation() -> None:
    """The emulator's teeth, on the plan itself: the graph after the break reads a bridge nobody
    fills."""
    compiled, config = hand_made(bridge=False)
    runtime = StageRuntime(compiled, config)
    w = torch.randn(H, H)
    with torch.no_grad():
        got, want = call(runtime, 5, w, seed=0)
    assert not torch.allclose(got, want)
    right = StageRuntime(dataclasses.replace(compiled, program=hand_made()[0].program), config)
    with torch.no_grad():
        got, want = call(right, 5, w, seed=0)
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

    compiled, config = hand_made()
    runtime = StageRuntime(compiled, dataclasses.replace(config, capture="lazy"), observer=observer)
    w = torch.randn(H, H)
    with torch.no_grad():
        for i, n in enumerate([5, 6, 12]):  # bucket 8 captured at its first use, then reused; then 16
            call(runtime, n, w, seed=i)
    start, bucket, record = heard[:3]
    assert start == CaptureStart("hand_made", "emulate", graphs_per_bucket=2, buckets=1)
    assert bucket.bucket == 8 and bucket.graphs == 2 and bucket.output_bytes > 0
    assert record.buckets == (bucket,) and record.failed is None and record.graphs == 2
    assert [type(e).__name__ for e in heard[3:]] == ["CaptureStart", "BucketCapture", "CaptureRecord"]
    assert runtime.capture_records() == [record, heard[-1]]

"""``runtime/observer.CaptureMeter``: what a capture run measures, bucket by bucket, and on which device."""

from __future__ import annotations

import time

import pytest
import torch

from ppcompile.runtime.observer import CaptureMeter


def test_graph_memory_is_read_on_the_stages_device_not_the_current_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that drives stages on two GPUs captures one while the other is current: the reserved
    memory the meter compares is the stage's device's."""
    reserved = {0: 100, 1: 1000}
    asked: list[object] = []

    def memory_reserved(device: object = None) -> int:
        asked.append(device)
        index = 0 if device is None else torch.device(device).index
        return reserved[index]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", memory_reserved)
    stage_device = torch.device("cuda", 1)
    meter = CaptureMeter("cuda", 2, [], time.perf_counter(), stage_device)
    reserved[1] += 64  # the stage's pool grew; the current device's did not
    done = meter.bucket_done(8, [torch.zeros(4)])
    assert done.pool_bytes == 64 and done.output_bytes == 16
    assert meter.record().measured_bytes == 64
    assert asked and all(d == stage_device for d in asked)


def test_an_emulated_run_measures_outputs_but_no_device_memory() -> None:
    held = torch.zeros(3)
    meter = CaptureMeter("emulate", 3, [held], time.perf_counter(), torch.device("cpu"))
    done = meter.bucket_done(4, [held, torch.zeros(2, 2)])  # the held buffer is not a graph output
    assert (done.graphs, done.output_bytes, done.pool_bytes) == (3, 16, None)
    record = meter.record()
    assert record.graphs == 3 and record.measured_bytes is None and record.failed is None

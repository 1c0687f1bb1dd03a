"""Padding rows of static buffers are zeroed only where an earlier call left rows written
(``static_buffers.zero_stale_rows``, ``graph_codegen.pad_marks``): every buffer a graph reads must still
hold zeros past the live rows up to the bucket, whatever count and bucket came before."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from mixer_stage import MixerStage, register_mixer
from runtime_helpers import symbolic_runtime

import ppcompile
from ppcompile.runtime.graph_codegen import pad_marks
from ppcompile.runtime.static_buffers import zero_stale_rows

H = 8
pytestmark = pytest.mark.usefixtures("fresh_dynamo", "one_thread")

mixer = register_mixer("pptest_marks::mixer", lambda x: None)


def _inputs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, r = torch.randn(n, H, generator=g) + 1, torch.randn(n, H, generator=g) + 1
    ppcompile.mark_token_dynamic(x, r)
    return x, r


def _padding_is_zero(m: torch.nn.Module, n: int, b: int) -> None:
    """Rows ``n:b`` of every input buffer and bridge of every instance are zero."""
    runtime = symbolic_runtime(m)
    for state in runtime.instances():
        buffers = {**state.input_buffers, **state.bridge_buffers}
        assert state.bridge_buffers, "the stage has a bridge"
        for slot, buf in buffers.items():
            assert torch.count_nonzero(buf[n:b]) == 0, (slot, n, b, buf[n:b])
            assert torch.count_nonzero(buf[:n]) > 0, (slot, n)  # live rows were written


@pytest.mark.parametrize("counts", [
    [(15, 16), (10, 16)],  # the same bucket, fewer rows
    [(12, 16), (3, 4), (7, 8), (16, 16), (2, 4)],  # down the ladder: rows past the bucket stay dirty
    [(3, 4), (13, 16), (13, 16), (8, 8), (15, 16), (9, 16)],
])
def test_rows_an_earlier_call_wrote_are_zero_up_to_the_bucket(counts: list[tuple[int, int]]) -> None:
    m = MixerStage(torch.ops.pptest_marks.mixer, H)
    options = {"graph_mode": "emulate", "capture_sizes": [4, 8, 16]}
    c = torch.compile(m, backend="pp_breakable", options=options)
    with torch.no_grad():
        c(*_inputs(5, seed=99))
        for i, (n, b) in enumerate(counts):
            x, r = _inputs(n, seed=i)
            for got, want in zip(c(x, r), m(x, r)):
                torch.testing.assert_close(got, want)
            assert symbolic_runtime(m).plan.bucket(n) == b
            _padding_is_zero(m, n, b)


def _pass_through(category: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any) -> Any:
        return fn(*args)

    return wrapped


def test_instrumented_calls_keep_the_marks_of_the_plain_path() -> None:
    """The instrumented path (copies called through wrappers) writes the same buffers: a plain call after
    it zeroes the rows it wrote."""
    m = MixerStage(torch.ops.pptest_marks.mixer, H)
    c = torch.compile(m, backend="pp_breakable", options={"graph_mode": "emulate", "capture_sizes": [8, 16]})
    with torch.no_grad():
        c(*_inputs(10, seed=0))
        runtime = symbolic_runtime(m)
        for i, (n, wrapped) in enumerate([(10, False), (15, True), (9, False), (12, True), (11, True)]):
            x, r = _inputs(n, seed=i)
            if wrapped:
                with runtime.instrumented(_pass_through):
                    got = c(x, r)
            else:
                got = c(x, r)
            for g, want in zip(got, m(x, r)):
                torch.testing.assert_close(g, want)
            _padding_is_zero(m, n, 16)


def test_zero_stale_rows_zeroes_only_rows_written_since() -> None:
    buf = torch.zeros(16, 2)
    marks = [0]
    steps = [(9, 16, 0, 9), (7, 16, 9, 7), (12, 16, 7, 12), (3, 4, 12, 12), (7, 8, 12, 12), (2, 16, 12, 2)]
    for n, b, before, after in steps:
        assert marks[0] == before
        zero_stale_rows(buf[:b], 0, n, b, marks, 0)
        buf[:n] = 1.0
        assert marks[0] == after
        assert torch.count_nonzero(buf[n:b]) == 0, (n, b)


def test_buffers_a_graph_writes_in_place_get_no_mark() -> None:
    m = MixerStage(torch.ops.pptest_marks.mixer, H)
    c = torch.compile(m, backend="pp_breakable", options={"graph_mode": "emulate", "capture_sizes": [8]})
    with torch.no_grad():
        c(*_inputs(5, seed=0))
    program = symbolic_runtime(m).program
    marks = pad_marks(program, fused=False)
    assert set(marks) == set(program.buffers)  # every buffer of this stage: one token dim, no graph writes
    assert pad_marks(program, fused=True) == {s: k for s, k in marks.items()
                                              if all(s not in p.fused for p in program.copy_points)}
    slot = next(iter(program.buffers))  # a graph writing it in place writes its padding rows too
    steps = tuple(dataclasses.replace(st, writes_buffers=(slot,)) if st.is_graph else st
                  for st in program.steps)
    assert slot not in pad_marks(dataclasses.replace(program, steps=steps), fused=False)

"""A bad input is named as one (docs/reliability.md, "Bad input"), never as a capture failure.

* A call whose inputs differ in structure from the first call's (a dtype here) makes Dynamo recompile
  the stage: the recompile is reported once (a warning naming the input, ``counters.input_recompiles``,
  ``describe()``), its first call runs eagerly, so a bad input raises ``InputMismatchError`` (a
  ``ValueError``) naming the input and both layouts before any capture, and the next good call is served
  by the first stage graph. A recompile whose inputs do work gets graphs from its second call.
* A first call whose forward fails without graphs too is not reported as a capture failure: the model's
  own error is raised, graphs stay on, and the next good call captures.
* With Dynamo's guards skipped, a wrong input is refused before a capture, not during one.
"""

from __future__ import annotations

import logging

import pytest
import torch
from reliability_helpers import H, Stage, check, compile_stage, inputs, no_guards

from ppcompile import counters, stage_runtimes
from ppcompile.runtime.validation import InputMismatchError


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_recompile_for_a_bad_dtype_is_named_and_raises_before_any_capture(
        caplog: pytest.LogCaptureFixture) -> None:
    m = Stage()
    c = compile_stage(m)
    with torch.no_grad():
        check(c, m, *inputs(5))
        captures = counters.captures
        x, residual = inputs(6, seed=1)
        with pytest.raises(InputMismatchError, match=r"input 'l_x_': float32 on cpu, 2-d -> float64 on cpu, "
                                                     r"2-d.*fails on them without graphs \(RuntimeError"):
            c(x.double(), residual)
        assert counters.captures == captures  # refused before any capture
        assert counters.input_recompiles == 1
        first, recompile = stage_runtimes()
        assert recompile.compiled.record.recompile_of == first.compiled.name
        assert "input 'l_x_': float32 on cpu, 2-d -> float64 on cpu, 2-d" in recompile.describe()
        (warning,) = [w for w in _warnings(caplog) if "differ in structure" in w]
        assert "l_x_" in warning and first.compiled.name in warning
        with counters.expect(replays=1, eager_runs=0, backend_compiles=0):
            check(c, m, *inputs(7, seed=2))  # the first stage graph serves the next good call
        assert not recompile.instances()


class AddsResidual(torch.nn.Module):
    """graph (linear) | break (mixer) | graph (+ residual): a float64 residual promotes, and works."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(H, H)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.ops.pptest_rel.mixer(self.lin(x)) * 2 + residual,)


def test_a_recompile_whose_inputs_work_serves_its_first_call_eagerly_then_graphs() -> None:
    m = AddsResidual()
    c = compile_stage(m)
    with torch.no_grad():
        check(c, m, *inputs(5))
        x, residual = inputs(6, seed=1)
        with counters.expect(eager_runs=1, replays=0, input_recompiles=1):
            check(c, m, x, residual.double())
        with counters.expect(replays=2, eager_runs=0, backend_compiles=0):
            x, residual = inputs(7, seed=2)
            check(c, m, x, residual.double())
            check(c, m, *inputs(3, seed=3))


def test_a_first_call_that_fails_without_graphs_raises_the_models_error_and_keeps_graphs_on() -> None:
    m = Stage()
    c = compile_stage(m)
    x, residual = inputs(5)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="dtype") as info:
            c(x.double(), residual)
        assert "capturing segment" not in str(info.value)
        assert any("not a capture failure" in note for note in getattr(info.value, "__notes__", []))
        assert not any(rt.fall_offs() for rt in stage_runtimes())
        check(c, m, *inputs(6, seed=1))  # a recompile for the good dtype, probed eagerly
        with counters.expect(replays=1, eager_runs=0):
            check(c, m, *inputs(7, seed=2))


def test_without_guards_a_wrong_input_is_refused_before_a_lazy_capture() -> None:
    m = Stage()
    c = compile_stage(m, capture="lazy", guard_filter_fn=no_guards)
    with torch.no_grad():
        check(c, m, *inputs(5))  # captures bucket 8 only
        captures = counters.captures
        x, residual = inputs(12, seed=1)  # bucket 16: not captured yet
        with pytest.raises(InputMismatchError, match=r"input 'l_residual_'.*dtype"):
            c(x, residual.double())
        assert counters.captures == captures
        with counters.expect(replays=1, eager_runs=0):
            check(c, m, x, residual)

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
from reliability_helpers import OPTIONS, H, Stage, check, compile_stage, inputs, no_guards

import ppcompile
from ppcompile import counters, stage_runtimes
from ppcompile.models import (
    REFERENCE_CONFIGS,
    make_batch,
    make_forward_context,
    make_stage,
    set_forward_context,
)
from ppcompile.runtime.validation import InputMismatchError

PP_CFG = REFERENCE_CONFIGS["tiny"]
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


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
        assert "l_x_" in warning and recompile.compiled.name in warning
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


def test_a_missing_proxy_key_leaves_later_good_calls_on_the_stage_graph(
        caplog: pytest.LogCaptureFixture) -> None:
    """A call without a proxy key makes the model raise while Dynamo retraces the stage, and Dynamo then
    runs the frame uncompiled for good, later good calls as several stage graphs of the functions it
    calls. ppcompile names the failed recompile once and has the frame compiled again: each good call
    after a bad one is served by the first stage graph (at most one, in a run of bad calls that compiled
    nothing, runs uncompiled first), and no other stage graph is built."""
    stage = make_stage(PP_CFG, 1, 2)
    compiled = torch.compile(stage, backend="pp_breakable", options={**OPTIONS, "capture_sizes": [8, 16]})
    first_runtimes = None
    uncompiled = 0
    for i, (n, drop) in enumerate([(5, None), (6, "residual"), (7, None), (9, None), (6, "residual"),
                                   (6, "hidden_states"), (7, None), (12, None), (16, None)]):
        ids, positions, proxies = make_batch(PP_CFG, [n], 1, 2, seed=i)
        if i == 0:
            ppcompile.mark_token_dynamic(ids, positions, proxies)
        if drop is not None:
            proxies = ppcompile.PPProxyTensors({k: v for k, v in proxies.items() if k != drop})
        ctx = make_forward_context([n], PP_CFG, range(stage.start_layer, stage.end_layer))
        with torch.inference_mode(), set_forward_context(ctx):
            if drop is not None:
                with pytest.raises(ValueError, match=f"must contain '{drop}'"):
                    compiled(ids, positions, pp_proxy_tensors=proxies)
                continue
            replays = counters.replays
            got = compiled(ids, positions, pp_proxy_tensors=proxies).clone()
            torch.testing.assert_close(got, stage(ids, positions, pp_proxy_tensors=proxies))
            uncompiled += counters.replays == replays
        first_runtimes = first_runtimes or stage_runtimes()
    assert uncompiled <= 1
    assert stage_runtimes() == first_runtimes and len(first_runtimes) == 1
    assert counters.input_recompiles >= 1
    assert len([w for w in _warnings(caplog) if "could not recompile the frame" in w]) == 1


def test_the_stage_compiled_for_another_backend_beside_is_no_failed_recompile(
        caplog: pytest.LogCaptureFixture) -> None:
    """An engine compiles the same stage with ``backend="eager"`` beside it (a reference run): Dynamo
    recompiles the shared frame for that backend, and the compile succeeds without calling this one. No
    failed recompile is reported, and the ``pp_breakable`` stage keeps serving from its graphs."""
    stage = make_stage(PP_CFG, 1, 2)
    compiled = torch.compile(stage, backend="pp_breakable", options={**OPTIONS, "capture_sizes": [8, 16]})
    reference = torch.compile(stage, backend="eager")
    for i, n in enumerate([5, 6, 7, 12]):
        ids, positions, proxies = make_batch(PP_CFG, [n], 1, 2, seed=i)
        if i == 0:
            ppcompile.mark_token_dynamic(ids, positions, proxies)
        ctx = make_forward_context([n], PP_CFG, range(stage.start_layer, stage.end_layer))
        with torch.inference_mode(), set_forward_context(ctx):
            want = stage(ids, positions, pp_proxy_tensors=proxies)
            if i == 0:
                got = compiled(ids, positions, pp_proxy_tensors=proxies)
            else:
                with counters.expect(replays=1, eager_runs=0):
                    got = compiled(ids, positions, pp_proxy_tensors=proxies)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(reference(ids, positions, pp_proxy_tensors=proxies), want)
    assert counters.input_recompiles == 0
    assert not [w for w in _warnings(caplog) if "could not recompile the frame" in w]
    assert len(stage_runtimes()) == 1

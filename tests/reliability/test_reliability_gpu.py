"""The reliability guarantees on real CUDA graphs: input checks, stale outputs, and a failure or an
interrupt raised while a stream is capturing (the CPU tests cover the same runtime with the emulator)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from reliability_helpers import Stage, assert_matches, compile_stage, inputs, no_guards, runtime
from runtime_helpers import CaptureHooks

from ppcompile import counters
from ppcompile.runtime.stale_outputs import StaleOutputError
from ppcompile.runtime.validation import InputMismatchError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _cuda_inputs(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    x, r = inputs(n, seed)
    return x.cuda(), r.cuda()


def _check(c: Any, m: Stage, n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    args = _cuda_inputs(n, seed)
    got = tuple(c(*args))
    assert_matches(got, m(*args))
    return got


def test_cuda_without_guards_a_cpu_input_is_rejected() -> None:
    m = Stage().cuda()
    c = compile_stage(m, graph_mode="cuda", guard_filter_fn=no_guards)
    with torch.no_grad():
        _check(c, m, 5)
        assert runtime().graph_mode == "cuda"
        x, r = _cuda_inputs(5)
        pattern = r"input 'l_residual_' .*expected device cuda:0, got cpu"
        with pytest.raises(InputMismatchError, match=pattern):
            c(x, r.cpu())
        _check(c, m, 7, seed=1)


def test_cuda_debug_stale_output_raises() -> None:
    m = Stage().cuda()
    c = compile_stage(m, graph_mode="cuda", debug=True, owned_outputs=False)  # debug checks the views
    with torch.no_grad():
        first, _ = _check(c, m, 5)
        view = first[:2]
        _check(c, m, 6, seed=1)
        with pytest.raises(StaleOutputError, match="stale output 0"):
            _ = first + 0
        assert torch.isnan(view).all()


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_cuda_a_fault_while_the_stream_is_capturing(exc: type) -> None:
    fired: list[bool] = []

    def faulting(key: tuple[int, int], fn: Any) -> Any:
        def body(*a: Any) -> Any:
            out = fn(*a)
            if torch.cuda.is_current_stream_capturing() and not fired:
                fired.append(True)
                raise exc("fault during stream capture (test)")
            return out

        return body

    m = Stage().cuda()
    c = compile_stage(m, graph_mode="cuda")
    hooks = CaptureHooks(segment=faulting)  # the CUDA executor captures ``body`` instead of the segment
    with torch.no_grad(), hooks.injected():
        with pytest.raises(exc):
            c(*_cuda_inputs(5))
        torch.cuda.synchronize()  # the device and the stream are usable again
        for i, n in enumerate([5, 9, 16, 3]):
            _check(c, m, n, seed=i)
        if exc is KeyboardInterrupt:  # captured again, graphs in use
            assert counters.replays == 4
        else:  # graphs off for this instance, eager and correct
            assert counters.replays == 0 and counters.eager_runs == 4

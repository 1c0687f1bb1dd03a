"""The graph path with fused copies (``copy_kernel="triton"``): one copier call per copy point, the same
answers as the per-tensor torch ops, and padding rows that stay zero under stress.

On CPU the Triton kernels run under its interpreter (``TRITON_INTERPRET=1``): slow per launch, so the
stage is tiny and streams are short.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mixer_stage import MixerStage, register_mixer
from runtime_helpers import symbolic_runtime

import ppcompile

H = 8
SIZES = [4, 8, 16]
mixer = register_mixer("pptest_fused_rt::mixer", lambda x: None)


def _compile(m: torch.nn.Module, **options: Any) -> Any:
    opts = {"capture_sizes": SIZES, "graph_mode": "emulate", "split_ops": ["pptest_fused_rt::mixer"],
            **options}
    return torch.compile(m, backend="pp_breakable", options=opts)


def _received(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states and residual as column slices of one receive buffer (strided sources)."""
    recv = torch.randn(n, 2 * H, generator=torch.Generator().manual_seed(seed))
    x, r = recv[:, :H], recv[:, H:]
    ppcompile.mark_token_dynamic(x, r)
    return x, r


def _counting(calls: dict[str, int]) -> Callable[[str, Callable[..., Any]], Callable[..., Any]]:
    def wrap(category: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any) -> Any:
            calls[category] = calls.get(category, 0) + 1
            return fn(*args)
        return counted
    return wrap


@pytest.mark.usefixtures("interpret", "fresh_dynamo", "one_thread")
@pytest.mark.parametrize("mode", ["emulate", "eager"])
def test_fused_copies_match_the_torch_ops_bit_for_bit_with_one_call_per_copy_point(mode: str) -> None:
    m = MixerStage(mixer, H)
    fused, plain = _compile(m, graph_mode=mode, copy_kernel="triton"), _compile(m, graph_mode=mode,
                                                                               copy_kernel="torch")
    with torch.inference_mode():
        for i, n in enumerate([5, 16, 3, 9, 17]):  # off a bucket, exactly one, the smallest, above the cap
            x, r = _received(n, seed=i)
            for got, want, ref in zip(fused(x, r), plain(x, r), m(x, r)):
                assert torch.equal(got, want)
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    kernels = {rt.config.copy_kernel: rt.instances()[0].copy_kernel
               for rt in ppcompile.stage_runtimes() if rt.token_symbol is not None}
    assert kernels == {"triton": "triton", "torch": "torch"}
    runtime = [rt for rt in ppcompile.stage_runtimes()
               if rt.token_symbol is not None and rt.config.copy_kernel == "triton"][-1]
    calls: dict[str, int] = {}
    with torch.inference_mode(), runtime.instrumented(_counting(calls)):
        x, r = _received(6, seed=9)
        fused(x, r)
    # Two inputs, one copier call; one bridged break output, one call.
    assert calls == {"copy-in": 1, "graph replays": 2, "break segments": 1, "bridge copies": 1}


def test_copy_kernel_auto_keeps_the_torch_ops_on_cpu() -> None:
    m = MixerStage(mixer, H)
    c = _compile(m)
    with torch.inference_mode():
        c(*_received(5, seed=0))
    (state,) = symbolic_runtime(m).instances()
    assert state.copy_kernel == "torch" and state.copiers is None


def test_copy_kernel_triton_without_triton_support_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU without the interpreter: the first graph-path call says why, naming the option to change."""
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    m = MixerStage(mixer, H)
    c = _compile(m, copy_kernel="triton")
    with torch.inference_mode(), pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        c(*_received(5, seed=0))


class _Stress:
    """A compiled stage after one call at the largest bucket, its static buffers filled with NaN."""

    def __init__(self, copy_kernel: str) -> None:
        torch._dynamo.reset()
        self.module = MixerStage(mixer, H)
        self.compiled = _compile(self.module, copy_kernel=copy_kernel)
        with torch.inference_mode():
            self.compiled(*_received(SIZES[-1], seed=0))
        (self.state,) = symbolic_runtime(self.module).instances()
        self.buffers = [*self.state.input_buffers.values(), *self.state.bridge_buffers.values()]
        assert len(self.buffers) == 3  # x, residual, the mixer's output
        with torch.inference_mode():  # the buffers are inference tensors, as the calls made them
            for buf in self.buffers:
                buf.fill_(float("nan"))


_STRESS: dict[str, _Stress] = {}


@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize("copy_kernel", ["torch", "triton"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(counts=st.lists(st.integers(1, SIZES[-1]), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_padding_rows_are_exactly_zero_after_every_call(
    copy_kernel: str, counts: list[int], seed: int
) -> None:
    """Static buffers full of NaN, then random calls: rows ``[n:b]`` of every input buffer and bridge are
    exactly zero after each call (a NaN left there would reach every padded row), and results are eager's."""
    stress = _STRESS.get(copy_kernel) or _STRESS.setdefault(copy_kernel, _Stress(copy_kernel))
    with torch.inference_mode():
        for i, n in enumerate(counts):
            x, r = _received(n, seed=seed + i)
            before = ppcompile.counters.snapshot()["replays_by_bucket"]
            got = stress.compiled(x, r)
            for g, want in zip(got, stress.module(x, r)):
                torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-5)
            served = {b for b, k in ppcompile.counters.snapshot()["replays_by_bucket"].items()
                      if k != before.get(b, 0)}
            if not served:
                continue  # the padding guard sent it eagerly: no buffer was written
            (b,) = served
            for buf in stress.buffers:
                assert torch.equal(buf[n:b], torch.zeros_like(buf[n:b])), f"rows {n}:{b} of a static buffer"

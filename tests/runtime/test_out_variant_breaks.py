"""Out-variant break ops: a break that writes into a tensor the graph segment before it allocated (as
vLLM's ``unified_attention_with_output`` does) needs no bridge. The graph after it reads the written
static memory itself, on every graph mode and at every bucket; the report says so."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from mixer_stage import mix_rows
from runtime_helpers import symbolic_runtime

import ppcompile
from ppcompile.debug.report import build_report

H = 8
SIZES = [4, 8, 16]
pytestmark = pytest.mark.usefixtures("fresh_dynamo", "one_thread")


@torch.library.custom_op("pptest_outvar::mix_into", mutates_args=("out",))
def mix_into(x: torch.Tensor, out: torch.Tensor) -> None:
    """The mixer written into ``out`` (its first ``x.shape[0]`` rows)."""
    out.copy_(mix_rows(x))


@mix_into.register_fake
def _(x: torch.Tensor, out: torch.Tensor) -> None:
    return None


class OutVariantStage(torch.nn.Module):
    """graph (up, allocate ``out``) | break (``mix_into(h, out)``) | graph (down)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(H, 2 * H), torch.nn.Linear(2 * H, H)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.up(x + residual))
        out = torch.empty_like(h)
        mix_into(h, out)
        y = self.down(out)
        return y, y + residual


def _counting(calls: list[str]) -> Callable[[str, Callable[..., Any]], Callable[..., Any]]:
    def wrap(category: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any) -> Any:
            calls.append(category)
            return fn(*args)
        return counted
    return wrap


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("mode", [
    "emulate", "eager", "none",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                     reason="needs a CUDA device")]),
])
def test_an_out_variant_break_writes_in_place_at_every_bucket(mode: str, compiler: str) -> None:
    device = "cuda" if mode == "cuda" else "cpu"
    m = OutVariantStage().to(device)
    options = {"graph_mode": mode, "segment_compiler": compiler, "capture_sizes": SIZES,
               "split_ops": ["pptest_outvar::mix_into"]}
    c = torch.compile(m, backend="pp_breakable", options=options)
    counts = [3, 4, 5, 8, 9, 16, 17]  # every bucket, exactly and off it, and above the cap
    graphed = mode != "none"
    with torch.no_grad(), ppcompile.counters.expect(replays=6 if graphed else 0):
        for i, n in enumerate(counts):
            g = torch.Generator().manual_seed(i)
            x, r = (torch.randn(n, H, generator=g).to(device) for _ in range(2))
            ppcompile.mark_token_dynamic(x, r)
            for got, want in zip(c(x, r), m(x, r)):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    runtime = symbolic_runtime(m)
    program = runtime.program
    (brk,) = [st for st in program.steps if not st.segment.is_graph]
    assert not program.bridge_buffers and brk.bridges == ()
    (written,) = brk.in_place
    producer = next(st for st in program.steps if st.segment.is_graph and written in st.out_slots)
    assert producer.index < brk.index
    (segment,) = [s for s in build_report(runtime)["segments"] if s["index"] == brk.index]
    assert segment["writes_static"] == [] and segment["writes_in_place"] == [f"{producer.segment.name}[1]"]
    if not graphed:
        return
    assert list(runtime.captured_buckets().values()) == [tuple(SIZES)]
    calls: list[str] = []
    with torch.no_grad(), runtime.instrumented(_counting(calls)):
        x, r = torch.randn(5, H, device=device), torch.randn(5, H, device=device)
        ppcompile.mark_token_dynamic(x, r)
        for got, want in zip(c(x, r), m(x, r)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The live inputs are copied in (two per-tensor copies, or one fused launch on CUDA) before the
    # first replay; nothing is copied after the break.
    assert calls[-3:] == ["graph replays", "break segments", "graph replays"]
    assert set(calls[:-3]) == {"copy-in"}


def test_a_break_returning_a_fresh_tensor_is_bridged_and_the_report_says_copied() -> None:
    """The contrast: the same stage with a functional mixer copies its output into a static bridge."""

    @torch.library.custom_op("pptest_outvar::mix", mutates_args=())
    def mix(x: torch.Tensor) -> torch.Tensor:
        return mix_rows(x)

    @mix.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    class Functional(OutVariantStage):
        def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = self.down(mix(torch.relu(self.up(x + residual))))
            return y, y + residual

    m = Functional()
    c = torch.compile(m, backend="pp_breakable", options={"graph_mode": "emulate", "capture_sizes": SIZES,
                                                          "split_ops": ["pptest_outvar::mix"]})
    with torch.no_grad():
        x, r = torch.randn(5, H), torch.randn(5, H)
        ppcompile.mark_token_dynamic(x, r)
        c(x, r)
    runtime = symbolic_runtime(m)
    (brk,) = [st for st in runtime.program.steps if not st.segment.is_graph]
    assert len(brk.bridges) == 1 and brk.in_place == ()
    (segment,) = [s for s in build_report(runtime)["segments"] if s["index"] == brk.index]
    assert len(segment["writes_static"]) == 1 and segment["writes_in_place"] == []

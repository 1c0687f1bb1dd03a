"""The flat program: values that cross from graph segments to break segments and outputs."""

from __future__ import annotations

import pytest
import torch

import ppcompile


@torch.library.custom_op("pptest_prog::scale", mutates_args=())
def _scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


@_scale.register_fake
def _(x: torch.Tensor, factor: float) -> torch.Tensor:
    return torch.empty_like(x)


class NumberAcrossBreak(torch.nn.Module):
    """A number computed in a graph segment (from a float attribute) read by a break segment."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.factor = 0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        h = self.lin(x)
        f = self.factor * 3
        return self.lin(torch.ops.pptest_prog.scale(h, f)), f


@pytest.mark.parametrize("graph_mode", ["emulate", "eager"])
def test_number_from_a_graph_segment_reaches_breaks_and_outputs(graph_mode: str) -> None:
    torch._dynamo.reset()
    m = NumberAcrossBreak()
    c = torch.compile(m, backend="pp_breakable", dynamic=True, options={
        "capture_sizes": [8, 16], "split_ops": ["pptest_prog::scale"], "graph_mode": graph_mode})
    with torch.no_grad():
        for n in (5, 9, 16):
            x = torch.randn(n, 8)
            with ppcompile.counters.expect(replays=1):
                got, f = c(x)
            want, f_want = m(x)
            torch.testing.assert_close(got, want)
            assert f == pytest.approx(f_want)

"""Tests of ``plan_output_trim``: each output's live size as an expression of the token count."""

from __future__ import annotations

import torch
from fx_helpers import dynamo_graph, make_ctx, run_until
from torch.utils._sympy.functions import FloorDiv

from ppcompile.passes.context import OutputTrim
from ppcompile.passes.plan_output_trim import plan_output_trim
from ppcompile.symbolic import SizeFn


class _Outputs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.lin(x)
        half = h[: x.shape[0] // 2] * 2
        norm = self.lin.weight.sum(1)  # a reduction over a parameter: no token dim
        return h, norm, half, h.t().contiguous()


def test_trims_only_outputs_with_token_dims() -> None:
    m = _Outputs()
    gm, ex = dynamo_graph(m, torch.randn(7, 8))
    ctx = make_ctx(gm, ex)
    split = run_until(gm, ctx, plan_output_trim)
    s0 = ctx.token_symbol
    assert ctx.trims == [
        OutputTrim(0, ((0, s0),)),
        OutputTrim(2, ((0, FloorDiv(s0, 2)),)),
        OutputTrim(3, ((1, s0),)),
    ]
    with torch.no_grad():
        outs = split(*ex)
    for trim in ctx.trims:  # the trims give the eager sizes
        for dim, expr in trim.dims:
            assert outs[trim.output_index].shape[dim] == SizeFn(expr)({s0: 7})


def test_static_graph_has_no_trims() -> None:
    gm, ex = dynamo_graph(_Outputs(), torch.randn(8, 8), dynamic=False)
    ctx = make_ctx(gm, ex)
    run_until(gm, ctx, plan_output_trim)
    assert ctx.trims == []

"""Pass ``plan_output_trim``: how each stage output gets back to its live size.

A graph segment computes ``b`` rows (the bucket); the caller must see ``n``. For every output, the
token dims and their size expressions give the live shape: ``narrow(dim, 0, expr(n))`` on each.
Outputs of break segments are already live-sized and get no trim.

Before (split graph)::

    def forward(self, s0, L_x_, L_w_):
        submod_0 = self.submod_0(L_x_, L_w_)     # f32[s0, 64], f32[s0//2, 128]
        getitem = submod_0[0];  getitem_1 = submod_0[1]
        return (getitem, getitem_1)

After (same code; plans recorded)::

    ctx.trims == [OutputTrim(0, ((0, s0),)), OutputTrim(1, ((0, s0//2),))]
"""

from __future__ import annotations

import torch

from ppcompile.passes.context import OutputTrim, PassContext, PassResult
from ppcompile.symbolic import example_value, shape_exprs

__all__ = ["plan_output_trim"]


def plan_output_trim(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Fills ``ctx.trims`` with one entry per tensor output that has token dims."""
    ctx.trims = []
    if ctx.is_static:
        return PassResult(gm, modified=False)
    (out,) = gm.graph.find_nodes(op="output")
    results = out.args[0]
    flat = results if isinstance(results, (tuple, list)) else (results,)
    for i, node in enumerate(flat):
        value = example_value(node) if isinstance(node, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor):
            continue
        dims = tuple((d, e) for d, e in enumerate(shape_exprs(value)) if ctx.token_symbol in e.free_symbols)
        if dims:
            ctx.trims.append(OutputTrim(i, dims))
    return PassResult(gm, modified=False)

"""``analysis/mutation.py``: which inputs an op writes in place, through views, and which arguments a
segment writes (the fact ``lift_static_inputs`` records for lowering)."""

from __future__ import annotations

import torch

from ppcompile.analysis.mutation import mutated_inputs, written_arguments_of


def _traced(fn: object) -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(fn)  # type: ignore[arg-type]


def test_an_in_place_method_through_views_writes_the_viewed_input() -> None:
    def segment(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        residual.view(-1)[:4].add_(1)
        return x + 1

    gm = _traced(segment)
    (add_,) = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "add_"]
    assert [p.name for p in mutated_inputs(add_)] == ["residual"]
    assert written_arguments_of(gm) == (1,)


def test_out_arguments_and_in_place_methods_count_pure_ops_do_not() -> None:
    def segment(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        torch.add(a, 1, out=c)
        b.t().mul_(2)
        return a * 2

    assert written_arguments_of(_traced(segment)) == (1, 2)


def test_a_segment_that_writes_nothing() -> None:
    def segment(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x).contiguous()

    assert written_arguments_of(_traced(segment)) == ()

"""Tests of ``SizeFn`` (fast evaluation of size expressions for a token count), ``first_decrease`` and
``size_hints``."""

from __future__ import annotations

import pickle

import sympy
import torch
from torch.utils._sympy.functions import FloorDiv, Mod

from ppcompile.symbolic import SizeFn, example_value, first_decrease, size_expr, size_hints

S0 = sympy.Symbol("s0", integer=True, positive=True)
S1 = sympy.Symbol("s1", integer=True, positive=True)


def test_constant() -> None:
    fn = SizeFn(sympy.Integer(64))
    assert fn({}) == 64 and fn({S0: 3}) == 64
    assert fn.expr == 64


def test_the_symbol() -> None:
    fn = SizeFn(S0)
    assert [fn({S0: n}) for n in (1, 7, 8192)] == [1, 7, 8192]


def test_linear() -> None:
    fn = SizeFn(2 * S0 + 3)
    assert fn({S0: 5}) == 13
    assert SizeFn(4 * S0)({S0: 6}) == 24
    assert SizeFn(S0 - 1)({S0: 1}) == 0


def test_rational_coefficients_are_not_truncated() -> None:
    assert SizeFn(S0 / 2)({S0: 4}) == 2
    assert SizeFn((S0 + 1) / 2)({S0: 7}) == 4


def test_floordiv() -> None:
    fn = SizeFn(FloorDiv(S0, 2))
    assert fn({S0: 7}) == 3
    assert fn({S0: 8}) == 4
    assert SizeFn(FloorDiv(S0 + 3, 4))({S0: 9}) == 3


def test_general_expression_is_memoised() -> None:
    fn = SizeFn(sympy.Max(S0, 4) * S1)
    assert fn({S0: 2, S1: 3}) == 12
    assert fn({S0: 6, S1: 3}) == 18
    assert fn._cache == {(2, 3): 12, (6, 3): 18}
    assert fn({S0: 2, S1: 3}) == 12
    assert len(fn._cache) == 2
    square = SizeFn(S0 * S0)
    assert square({S0: 3}) == 9 and square._cache == {(3,): 9}


def test_one_evaluator_per_expression() -> None:
    assert SizeFn(2 * S0 + 1) is SizeFn(2 * S0 + 1)
    assert SizeFn(2 * S0 + 1) is not SizeFn(2 * S0 + 2)
    assert SizeFn(sympy.Tuple(S0, 4)) is SizeFn(sympy.Tuple(S0, 4))
    fn = SizeFn(3 * S0 + 2)
    assert pickle.loads(pickle.dumps(fn)) is fn


def test_size_expr_of_an_int() -> None:
    assert size_expr(5) == sympy.Integer(5)


def test_size_hints_are_the_traced_values_of_a_sizes_symbols() -> None:
    seen: list[torch.Size] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[object]) -> object:
        (out,) = gm.graph.find_nodes(op="output")[0].args[0]
        seen.append(example_value(out).shape)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda x: torch.cat([x, x]), backend=backend, dynamic=True)(torch.randn(6, 4))
    torch._dynamo.reset()
    rows, cols = seen[0]  # 2 * s0 and s1
    (s0,), (s1,) = size_expr(rows).free_symbols, size_expr(cols).free_symbols
    assert size_expr(rows) == 2 * s0 and size_hints(rows) == {s0: 6} and size_hints(cols) == {s1: 4}
    assert size_hints(5) == {}


def test_repr() -> None:
    assert repr(SizeFn(S0 + 1)) == "SizeFn(s0 + 1)"


def test_a_traced_shape_evaluates_to_a_torch_size() -> None:
    s = S0
    fn = SizeFn(sympy.Tuple(1, s, 2 * s))
    assert fn({s: 5}) == torch.Size([1, 5, 10]) and isinstance(fn({s: 5}), torch.Size)
    assert fn.expr.free_symbols == {s}


def test_first_decrease_finds_pad_counts_and_accepts_growing_sizes() -> None:
    s = S0
    pad = Mod(16 - Mod(s, 16), 16)
    assert first_decrease(pad, s, 64) == 1  # 15 pad rows at 1 token, 14 at 2
    assert first_decrease(s + pad, s, 64) is None  # rounded up to a multiple of 16: never shrinks
    assert first_decrease(FloorDiv(s, 4) + 3 * s, s, 64) is None
    assert first_decrease(sympy.Integer(7), s, 64) is None
    assert first_decrease(64 - s, s, 64) == 1


def test_merged_symbols_read_as_the_one_they_were_merged_into() -> None:
    """``merge_symbols``: sizes of the ShapeEnv read merged symbols as their target, in every expression
    and in the shape guards; a later merge into another symbol carries the earlier ones along. Dynamo's
    ShapeEnv is not changed."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from ppcompile.symbolic import merge_symbols, merged_symbols, shape_guards

    env = ShapeEnv()

    def sym(name: str) -> torch.SymInt:
        symbol = env.create_symbol(6, ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC)
        return env.create_symintnode(symbol, hint=6)

    a, b, c = sym("a"), sym("b"), sym("c")
    (sa,), (sb,), (sc,) = (x.node.expr.free_symbols for x in (a, b, c))
    assert len({sa, sb, sc}) == 3
    assert bool(b % 2 == 0)  # a guard on b alone
    merge_symbols(a, [sb], sa)
    assert size_expr(b) == sa and size_expr(2 * b + a) == 3 * sa and size_expr(c) == sc
    assert sympy.Eq(Mod(sa, 2), 0) in shape_guards(a, sa)
    merge_symbols(c, [sa], sc)
    assert merged_symbols(a) == {sa: sc, sb: sc}
    assert size_expr(b) == sc and size_expr(a + b) == 2 * sc
    assert b.node.expr == sb and not env.replacements  # the ShapeEnv itself is as it was

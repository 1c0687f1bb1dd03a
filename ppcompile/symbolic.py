"""Sympy helpers: symbolic sizes of traced values and fast evaluation for a token count."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sympy
import torch
from torch.utils._sympy.interp import sympy_interp
from torch.utils._sympy.reference import PythonReferenceAnalysis

__all__ = ["SizeFn", "example_value", "shape_exprs", "size_expr"]


def example_value(node: torch.fx.Node) -> Any:
    """The traced (fake) value of a node: Dynamo's ``example_value`` or AOT's ``val``."""
    return node.meta.get("example_value", node.meta.get("val"))


def size_expr(size: int | torch.SymInt) -> sympy.Expr:
    """A size as a sympy expression, with the ShapeEnv's replacements applied."""
    if isinstance(size, torch.SymInt):
        node = size.node
        expr = node.expr
        shape_env = getattr(node, "shape_env", None)
        if shape_env is not None:
            expr = shape_env.simplify(expr)
        return expr
    return sympy.Integer(int(size))


def shape_exprs(value: torch.Tensor) -> tuple[sympy.Expr, ...]:
    """The shape of a (fake) tensor as sympy expressions."""
    return tuple(size_expr(s) for s in value.shape)


class SizeFn:
    """Evaluates a size expression for concrete symbol values, quickly.

    The common forms (a constant, the symbol itself, ``a*s + c``) are evaluated arithmetically; anything
    else (``s // 2``, ``Max(...)``) goes through torch's sympy interpreter and is memoised.
    """

    __slots__ = ("_cache", "_const", "_expr", "_linear", "_symbols")

    def __init__(self, expr: sympy.Expr) -> None:
        self._expr = expr
        self._symbols = tuple(sorted(expr.free_symbols, key=str))
        self._const: int | None = int(expr) if not self._symbols else None
        self._linear: tuple[sympy.Symbol, int, int] | None = None
        if len(self._symbols) == 1:
            (s,) = self._symbols
            poly = sympy.Poly(expr, s) if expr.is_polynomial(s) else None
            if poly is not None and poly.degree() == 1 and all(x.is_integer for x in poly.all_coeffs()):
                a, c = (int(x) for x in poly.all_coeffs())
                self._linear = (s, a, c)  # s/2 has a rational coefficient: it goes to the interpreter
        self._cache: dict[tuple[int, ...], int] = {}

    @property
    def expr(self) -> sympy.Expr:
        return self._expr

    def __call__(self, env: Mapping[sympy.Symbol, int]) -> int:
        if self._const is not None:
            return self._const
        if self._linear is not None:
            s, a, c = self._linear
            return a * env[s] + c
        key = tuple(env[s] for s in self._symbols)
        out = self._cache.get(key)
        if out is None:
            out = int(sympy_interp(PythonReferenceAnalysis, dict(env), self._expr))
            if len(self._cache) < 65536:
                self._cache[key] = out
        return out

    def __repr__(self) -> str:
        return f"SizeFn({self._expr})"

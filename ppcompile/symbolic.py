"""Sympy helpers: symbolic sizes of traced values and fast evaluation for a token count."""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import sympy
import torch

from ppcompile.torch_internals import (
    shape_env_guards,
    shape_env_hints,
    symint_shape_env,
    sympy_interp_logger_name,
    sympy_interp_python,
)

__all__ = ["SizeFn", "example_value", "first_decrease", "first_exceeding", "holds_at", "merge_symbols",
           "merged_symbols", "shape_exprs", "shape_guards", "size_expr", "size_hints", "size_value_expr"]

# Per ShapeEnv (weakly): symbols ``find_token_dims`` merged into the token symbol (``merge_symbols``).
_MERGED: weakref.WeakKeyDictionary[Any, dict[sympy.Symbol, sympy.Symbol]] = weakref.WeakKeyDictionary()


def example_value(node: torch.fx.Node) -> Any:
    """The traced (fake) value of a node: Dynamo's ``example_value`` or AOT's ``val``."""
    return node.meta.get("example_value", node.meta.get("val"))


def size_expr(size: int | torch.SymInt) -> sympy.Expr:
    """A size as a sympy expression, with the ShapeEnv's replacements applied, and the symbols merged
    into the token symbol (``merge_symbols``) replaced by it."""
    if isinstance(size, torch.SymInt):
        node = size.node
        expr = node.expr
        shape_env = symint_shape_env(size)
        if shape_env is not None:
            expr = shape_env.simplify(expr)
            merged = _MERGED.get(shape_env)
            if merged:
                expr = expr.xreplace(merged)
        return expr
    return sympy.Integer(int(size))


def merge_symbols(size: torch.SymInt, symbols: Iterable[sympy.Symbol], into: sympy.Symbol) -> None:
    """From now on, ``size_expr`` of any size of ``size``'s ShapeEnv reads each of ``symbols`` as
    ``into``: Dynamo gave separately marked token dims symbols of their own (``s0``, ``s80``), and the
    stage serves them as one token count (``find_token_dims``; each call checks that they agree).
    Dynamo's ShapeEnv itself is left as it is. Merges already made for the ShapeEnv (an earlier graph of
    the same trace) keep pointing at one symbol."""
    shape_env = symint_shape_env(size)
    if shape_env is None:
        raise RuntimeError(f"merge_symbols: {size!r} belongs to no shape env (a traced SymInt has one)")
    merged = _MERGED.setdefault(shape_env, {})
    into = merged.get(into, into)
    for s in {merged.get(s, s) for s in symbols}:  # what each reads as so far
        if s != into:
            merged[s] = into
    for s, target in merged.items():  # an earlier merge into a symbol merged now
        if target in merged:
            merged[s] = into


def merged_symbols(size: torch.SymInt) -> dict[sympy.Symbol, sympy.Symbol]:
    """The symbols merged so far in ``size``'s ShapeEnv, each with the symbol it reads as."""
    shape_env = symint_shape_env(size)
    return dict(_MERGED.get(shape_env, {})) if shape_env is not None else {}


def size_hints(size: int | torch.SymInt) -> dict[sympy.Symbol, int | None]:
    """The traced value (the ShapeEnv's hint) of each symbol of ``size``'s expression, None where the
    ShapeEnv has none; empty for a plain int."""
    if not isinstance(size, torch.SymInt):
        return {}
    values = shape_env_hints(symint_shape_env(size))
    return {s: None if (v := values.get(s)) is None else int(v) for s in size_expr(size).free_symbols}


def size_value_expr(value: Any) -> sympy.Basic | None:
    """A traced number as an expression of the symbols, or None: a ``SymInt`` gives its expression, a
    ``torch.Size`` holding a ``SymInt`` (``x.shape``) a ``sympy.Tuple`` of them. Such values are
    evaluated where they are read, at the live count or the bucket, never carried across."""
    if isinstance(value, torch.SymInt):
        return size_expr(value)
    if isinstance(value, torch.Size) and any(isinstance(d, torch.SymInt) for d in value):
        return sympy.Tuple(*(size_expr(d) for d in value))
    return None


def shape_exprs(value: torch.Tensor) -> tuple[sympy.Expr, ...]:
    """The shape of a (fake) tensor as sympy expressions."""
    return tuple(size_expr(s) for s in value.shape)


_MAX_SIZE_FNS = 65536


class SizeFn:
    """Evaluates a size expression for concrete symbol values, quickly.

    The common forms (a constant, the symbol itself, ``a*s + c``) are evaluated arithmetically; anything
    else (``s // 2``, ``Max(...)``) goes through torch's sympy interpreter and is memoised. A
    ``sympy.Tuple`` (a traced ``torch.Size``) evaluates to a ``torch.Size``.
    """

    __slots__ = ("_cache", "_const", "_expr", "_items", "_linear", "_symbols")

    def __new__(cls, expr: sympy.Basic) -> SizeFn:
        # One per expression: a stage's layers repeat a handful of size expressions thousands of times,
        # and reading an expression's symbols is sympy's slowest step here.
        fn = _SIZE_FNS.get(expr)
        if fn is None:
            fn = super().__new__(cls)
            fn._setup(expr)
            if len(_SIZE_FNS) >= _MAX_SIZE_FNS:
                _SIZE_FNS.clear()
            _SIZE_FNS[expr] = fn
        return fn

    def _setup(self, expr: sympy.Basic) -> None:
        self._expr = expr
        self._symbols = tuple(sorted(expr.free_symbols, key=str))
        self._items = tuple(SizeFn(e) for e in expr) if isinstance(expr, sympy.Tuple) else None
        self._const: int | None = int(expr) if not self._symbols and self._items is None else None
        self._linear: tuple[sympy.Symbol, int, int] | None = None
        if len(self._symbols) == 1 and self._items is None:
            self._linear = _integer_linear(expr)
        self._cache: dict[tuple[int, ...], int] = {}

    def __reduce__(self) -> tuple[type[SizeFn], tuple[sympy.Basic]]:
        return SizeFn, (self._expr,)  # read back through the one evaluator per expression

    @property
    def expr(self) -> sympy.Basic:
        return self._expr

    def __call__(self, env: Mapping[sympy.Symbol, int]) -> Any:
        if self._items is not None:
            return torch.Size([f(env) for f in self._items])
        if self._const is not None:
            return self._const
        if self._linear is not None:
            s, a, c = self._linear
            return a * env[s] + c
        key = tuple(env[s] for s in self._symbols)
        out = self._cache.get(key)
        if out is None:
            out = int(sympy_interp_python(env, self._expr))
            if len(self._cache) < 65536:
                self._cache[key] = out
        return out

    def __repr__(self) -> str:
        return f"SizeFn({self._expr})"


_SIZE_FNS: dict[sympy.Basic, SizeFn] = {}


@functools.lru_cache(maxsize=4096)
def _integer_linear(expr: sympy.Expr) -> tuple[sympy.Symbol, int, int] | None:
    """``(s, a, c)`` when ``expr`` is ``a*s + c`` with integers ``a`` and ``c``, else None (``s/2`` has a
    rational coefficient: it goes to the interpreter). Read off sympy's canonical form, without building
    a polynomial: a stage's outputs repeat a handful of expressions hundreds of times."""
    (s,) = expr.free_symbols
    c, rest = expr.as_coeff_Add()
    a, symbol = rest.as_coeff_Mul()
    if symbol != s or not (a.is_Integer and c.is_Integer):
        return None
    return s, int(a), int(c)


@contextlib.contextmanager
def _quiet_interpreter() -> Iterator[None]:
    """Sweeps evaluate expressions where they may be undefined (a division by a size that is 0 below the
    range a graph was traced for); torch's interpreter logs a warning for each such point."""
    logger = logging.getLogger(sympy_interp_logger_name())
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def first_decrease(expr: sympy.Expr, symbol: sympy.Symbol, upto: int) -> int | None:
    """The first ``n`` in ``1..upto-1`` where ``expr`` at ``n + 1`` is below ``expr`` at ``n``, or None
    when ``expr`` never decreases there. Linear forms with a non-negative slope are decided at once;
    anything else (``Mod``, ``FloorDiv``, ...) is evaluated at every ``n`` where it is defined."""
    if expr.free_symbols != {symbol}:
        return None  # a constant, or other symbols: not a size of the token count alone
    if expr.is_polynomial(symbol):
        poly = sympy.Poly(expr, symbol)
        if poly.degree() <= 1 and poly.all_coeffs()[0] >= 0:
            return None
    fn = SizeFn(expr)
    previous: int | None = None
    with _quiet_interpreter():
        for n in range(1, upto + 1):
            try:
                value = fn({symbol: n})
            except (ArithmeticError, ValueError, TypeError):  # outside the range the graph was traced for
                previous = None
                continue
            if previous is not None and value < previous:
                return n - 1
            previous = value
    return None


def first_exceeding(a: sympy.Expr, b: sympy.Expr, symbol: sympy.Symbol, upto: int) -> int | None:
    """The first ``n`` in ``1..upto`` where ``a`` exceeds ``b``, or None (equal expressions at once;
    points where either is undefined are skipped)."""
    if sympy.simplify(a - b) == 0:
        return None
    fa, fb = SizeFn(a), SizeFn(b)
    with _quiet_interpreter():
        for n in range(1, upto + 1):
            try:
                if fa({symbol: n}) > fb({symbol: n}):
                    return n
            except (ArithmeticError, ValueError, TypeError, KeyError):
                continue
    return None


def shape_guards(size: torch.SymInt, symbol: sympy.Symbol) -> tuple[sympy.Basic, ...]:
    """The equality guards Dynamo's ShapeEnv recorded while tracing that mention ``symbol`` and no other
    symbol: the graph's sizes were simplified for token counts where they hold (``Eq(Mod(s0, 16), 15)``
    turns a pad count into the constant 1). Bounds and inequalities (``s0 < 4``, ``Ne(s0, 8)``) simplify
    no size; they say which branch the Python took (a sliding-window mask or none), which graphed
    token-local ops do not depend on. ``size`` is any SymInt of the graph (it carries the ShapeEnv).
    Symbols merged into ``symbol`` (``merge_symbols``) read as ``symbol`` here too."""
    shape_env = symint_shape_env(size)
    if shape_env is None:
        raise RuntimeError(f"shape_guards: {size!r} belongs to no shape env (a traced SymInt has one)")
    merged = _MERGED.get(shape_env)
    guards = tuple(g.xreplace(merged) for g in shape_env_guards(shape_env)) if merged \
        else shape_env_guards(shape_env)
    return tuple(e for e in guards if isinstance(e, sympy.Eq) and e.free_symbols == {symbol})


def holds_at(guards: tuple[sympy.Basic, ...], symbol: sympy.Symbol, value: int) -> bool:
    """Whether every guard holds with ``symbol = value`` (a guard undefined there does not)."""
    for guard in guards:
        try:
            if guard.xreplace({symbol: sympy.Integer(value)}) is not sympy.true:
                return False
        except (ArithmeticError, ValueError, TypeError):
            return False
    return True

"""One token count over inputs marked dynamic one by one: the per-call check, and the calls that fail it.

Dynamo gives each separately marked token dim a symbol of its own (vLLM marks ``input_ids``,
``positions`` and each PP proxy: ``[s0]``, ``[s80]``, ...). ``find_token_dims`` merged those that were
equal at the traced call into the token symbol, so the stage's plan (buckets, static buffers, trims, size
arguments) reads all of them as the one count ``n``. Nothing in Dynamo's graph says they stay equal (and
an engine may drop every guard), so each call compares them, a few size reads. A call where they
differ cannot be served by the plan: graphs pad every such input to one bucket, and the live path
evaluates every merged size at ``n``. It runs the traced graph op by op instead (the split module's FX
code, every size read off the live tensors: what Dynamo's graph computes for any sizes it accepts), with
one warning per stage graph naming the inputs; ``counters.token_count_mismatches`` counts such calls
(they are ``eager_runs`` too) and ``describe()`` lists the merge.

Not an error: the graph Dynamo traced serves such a call, and the merge was ppcompile's reading of it
(an input whose size matched the token count at the first call by chance reads as one more token
input; its calls then run eagerly, correct, and the warning says how to avoid that).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ppcompile.counters import counters
from ppcompile.runtime.compiled_stage import CompiledStage
from ppcompile.runtime.validation import InputMismatchError

__all__ = ["TokenCounts"]

log = logging.getLogger(__name__)


class TokenCounts:
    """The token dims of a stage graph's live inputs that must agree per call (the token input and every
    input whose symbol was merged into the token symbol); nothing to check when none was merged."""

    __slots__ = ("_compiled", "_dims", "_label", "mismatches")

    def __init__(self, compiled: CompiledStage, label: Callable[[], str]) -> None:
        merged = tuple((i, d) for i, d, _ in compiled.merged_token_dims)
        token = () if compiled.token_input is None or not merged else (compiled.token_input,)
        self._dims: tuple[tuple[int, int], ...] = (*token, *merged)
        self._compiled = compiled
        self._label = label
        self.mismatches = 0  # calls whose token dims differed (run eagerly)

    def differ(self, args: tuple[Any, ...], n: int) -> bool:
        """Whether a token dim of ``args`` that the stage reads as the token count is not ``n`` (a value
        that is no tensor of that rank is left to the input checks, which name it)."""
        for i, d in self._dims:
            a = args[i]
            if isinstance(a, torch.Tensor) and a.dim() > d and a.shape[d] != n:
                return True
        return False

    def _name(self, i: int) -> str:
        names = self._compiled.input_names
        return names[i] if i < len(names) else f"input {i}"

    def sizes(self, args: tuple[Any, ...]) -> str:
        """Each checked input's name, dim and size at this call."""
        def size(a: Any, d: int) -> object:
            return a.shape[d] if isinstance(a, torch.Tensor) and a.dim() > d else type(a).__name__

        return ", ".join(f"{self._name(i)} dim {d}: {size(args[i], d)}" for i, d in self._dims)

    def describe(self) -> str:
        """The merge, for ``describe()``: the inputs and Dynamo's symbols read as the token count."""
        c = self._compiled
        token = "" if c.token_input is None else f" ({self._name(c.token_input[0])} dim {c.token_input[1]})"
        merged = ", ".join(f"{self._name(i)} dim {d} ({symbol})" for i, d, symbol in c.merged_token_dims)
        return (f"one token count {c.token_symbol}{token} over inputs marked dynamic one by one: {merged} "
                f"read as {c.token_symbol}; {self.mismatches} call(s) where their sizes differed ran eagerly")

    def run_eager(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """Serves a call whose token dims differ: the traced graph op by op, on the live tensors."""
        split = self._compiled.record.split_module
        what = (f"the inputs it serves as one token count (marked dynamic one by one, equal at the traced "
                f"call) differ in size at this call ({self.sizes(args)})")
        if split is None:
            raise InputMismatchError(f"pp_breakable: {self._label()}: {what}, and this stage keeps no traced "
                                     "graph to run them by; pass inputs whose token dims agree")
        counters.eager_runs += 1
        counters.token_count_mismatches += 1
        self.mismatches += 1
        if self.mismatches == 1:
            log.warning("%s: %s: such calls run eagerly, the traced graph op by op (no graphs, no compiled "
                        "segments; counters.token_count_mismatches). If they hold one token count, pass "
                        "them with equal sizes; an input whose size equalled the token count at the first "
                        "call by chance is no token input: leave its dim unmarked, or make the first "
                        "call's sizes differ", self._label(), what)
        out = split(*args)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

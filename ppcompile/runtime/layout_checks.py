"""Layout checks for Inductor segments compiled without Inductor's per-input size asserts.

Inductor checks the size and stride of every input of a compiled graph on every call (``size_asserts``,
about 0.5 us per input, ~10 per decoder segment, mostly weights). Segments are compiled without them
(``backends/segment_compilers.SEGMENT_INDUCTOR_DEFAULTS``) because almost everything they read is
vouched for already: parameters by Dynamo's guards, intermediates by the compiled segment that made
them, static buffers by their allocation. What is left, the stage inputs and break outputs that
segments read at the live size, is checked here, once per value per call, by the generated live
forward (``codegen.py``)::

    L = layouts(env)  # expected (shape, stride, dtype, device) per checked value, memoised
    ...
    v22 = call_1(v18, z0, v19, v20)         # a break segment
    if not isinstance(v22, Tensor) or (v22.shape, v22.stride(), v22.dtype, v22.device) != L[3]:
        v22 = layouts.repair(3, v22, L[3])  # copy into the traced strides, or raise (shape, dtype, ...)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, NoReturn

import sympy
import torch

from ppcompile.runtime.program import Program
from ppcompile.runtime.static_buffers import TensorLayout, strides_match
from ppcompile.runtime.validation import GUARD_HINT, InputMismatchError

__all__ = ["CheckedValue", "LayoutMismatchError", "LiveLayouts", "checked_values"]

log = logging.getLogger(__name__)

Layout = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]  # as compared per call


class LayoutMismatchError(RuntimeError):
    """A break segment returned a tensor whose shape, dtype or device differs from the traced one."""


@dataclasses.dataclass(frozen=True)
class CheckedValue:
    """A tensor that graph segments read at the live size: a stage input or a break output."""

    slot: int
    what: str  # for messages: "input 'x'" or "the output 0 of break segment submod_1"
    is_input: bool
    layout: TensorLayout


class LiveLayouts:
    """Checks the tensors that Inductor segments read on the live path against their traced layout.

    Segments are compiled without Inductor's per-input size asserts (``segment_compilers``): their
    parameters are guarded by Dynamo, their intermediates come from other compiled segments, and the
    rest (stage inputs and break outputs) is checked here, once per value per call instead of once per
    reading segment. A stride that differs is copied into the traced layout; another shape, dtype or
    device raises (``InputMismatchError`` for an input, which only happens when Dynamo's guards were
    dropped; :class:`LayoutMismatchError` for a break op whose fake implementation promised otherwise).
    """

    def __init__(self, stage: str, checked: Sequence[CheckedValue]) -> None:
        self.stage = stage
        self.checked = list(checked)
        self._memo: dict[tuple[int, ...], tuple[Layout, ...]] = {}
        self._warned: set[int] = set()

    def __call__(self, env: Mapping[sympy.Symbol, int]) -> tuple[Layout, ...]:
        """The expected layout of each checked value for ``env`` (memoised by the env's values)."""
        key = tuple(env.values())
        hit = self._memo.get(key)
        if hit is None:  # every checked layout is computable for the call's env (checked_values)
            hit = tuple((*c.layout.at(env), c.layout.dtype, c.layout.device)  # type: ignore[misc]
                        for c in self.checked)
            if len(self._memo) < 4096:
                self._memo[key] = hit
        return hit

    def repair(self, i: int, value: Any, expected: Layout) -> torch.Tensor:
        """``value`` in the expected layout, or a clear error when it is not the traced kind of tensor."""
        c = self.checked[i]
        shape, stride, dtype, device = expected
        if not isinstance(value, torch.Tensor):
            self._fail(c, "a tensor", type(value).__name__)
        for what, want, got in (("dtype", dtype, value.dtype), ("device", device, value.device),
                                ("shape", list(shape), list(value.shape))):
            if want != got:
                self._fail(c, f"{what} {want}", f"{what} {got}")
        if strides_match(value.stride(), stride, shape):
            return value  # only strides of size-1 dims differ: they address no other element
        if i not in self._warned:
            self._warned.add(i)
            log.log(logging.INFO if c.is_input else logging.WARNING,
                    "%s: %s has strides %s where the trace has %s; it is copied into the traced layout "
                    "before compiled segments read it%s", self.stage, c.what, value.stride(), stride,
                    "" if c.is_input else " (fix the op's fake implementation to avoid the copy)")
        fixed = torch.empty_strided(shape, stride, dtype=value.dtype, device=value.device)
        fixed.copy_(value)
        return fixed

    def _fail(self, c: CheckedValue, expected: str, got: str) -> NoReturn:
        if c.is_input:
            raise InputMismatchError(
                f"pp_breakable: {c.what} of {self.stage}: expected {expected}, got {got}. {GUARD_HINT}")
        raise LayoutMismatchError(
            f"pp_breakable: {c.what} of {self.stage} returned {got}, but its trace (the op's fake "
            f"implementation) has {expected}, which the compiled segment after it reads. Fix the op's fake "
            "implementation (torch.library.opcheck tests it)")


def _described_layouts(program: Program) -> dict[int, tuple[str, bool, TensorLayout]]:
    """Each tensor input and break output by slot: what it is (for messages), whether it is an input,
    and its traced layout."""
    described = {slot: (f"input {name!r}", True, layout)
                 for slot, (name, layout) in program.input_layouts.items()}
    for st in program.break_steps:
        for i, slot in st.writes:
            layout = st.out_layouts[i] if i < len(st.out_layouts) else None
            if layout is not None:
                described[slot] = (f"the output {i} of break segment {st.segment.name}", False, layout)
    return described


def checked_values(
    program: Program, input_slots: Iterable[int], known: Collection[sympy.Symbol]
) -> list[CheckedValue]:
    """The tensors a graph step reads at the live size that need a check: the given stage inputs and
    every break output, each only if its sizes and strides are expressions of the ``known`` symbols (the
    ones a call binds; Dynamo guards the rest). Inputs first, then break outputs in step order."""
    known = frozenset(known)
    inputs = frozenset(input_slots)
    graph_reads = {r.slot for st in program.graph_steps for r in st.args if r.size is None}
    return [
        CheckedValue(slot, what, is_input, layout)
        for slot, (what, is_input, layout) in _described_layouts(program).items()
        if slot in graph_reads and (slot in inputs or not is_input)
        and all(f.expr.free_symbols <= known for f in (*layout.sizes, *layout.strides))
    ]

"""Input checks at the runtime boundary: what a graph-path call may be handed.

Dynamo's guards normally keep a compiled graph from ever seeing an input it was not traced for: a new
dtype, device, rank or fixed size, a new aliasing pattern or new strides make Dynamo recompile (or fail
in the model's own code while tracing), so such a call never reaches this stage graph's runtime. Guards
can be skipped, though (``guard_filter_fn``, an engine's custom dispatcher, a direct call of the
runtime), and then copy-in would go wrong quietly: ``copy_`` casts a wrong dtype, broadcasts a ``[T, 1]``
tensor into ``[T, H]`` and copies across devices. So every graph-path call checks the inputs it copies
into static buffers, one comparison per attribute (about 0.5 us per input), before it writes anything.

Inputs that share memory with the stage's own static buffers (an output of the previous call fed back
in) are legal; :func:`aliased_slots` finds them so the runtime can copy them first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import sympy
import torch

from ppcompile.symbolic import SizeFn

__all__ = [
    "GUARD_HINT",
    "InputMismatchError",
    "InputSpec",
    "aliased_slots",
    "check_inputs",
    "storages_of",
]

Env = Mapping[sympy.Symbol, int]

GUARD_HINT = (
    "Dynamo's guards normally recompile the stage for such an input; they were skipped here "
    "(guard_filter_fn, a custom dispatcher or a direct call). Pass inputs that match the compiled graph, "
    "or keep Dynamo's guards so that it recompiles"
)


class InputMismatchError(ValueError):
    """A graph-path call got an input that does not match the compiled stage graph."""


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """What one lifted input must look like: dtype, device, rank, and each dim's size.

    ``fixed`` dims have a constant size; ``sized`` dims have a size expression of the call's symbols
    (the token count ``n``: ``n``, ``2 * n``, ...), evaluated per call.
    """

    slot: int
    name: str
    dtype: torch.dtype
    device: torch.device
    ndim: int
    fixed: tuple[tuple[int, int], ...]
    sized: tuple[tuple[int, SizeFn], ...]

    def expected_shape(self, env: Env) -> tuple[int | str, ...]:
        shape: list[int | str] = ["?"] * self.ndim
        for d, size in self.fixed:
            shape[d] = size
        for d, fn in self.sized:
            shape[d] = fn(env)
        return tuple(shape)


def check_inputs(
    specs: Sequence[InputSpec], args: Sequence[Any], num_inputs: int, env: Env, stage: str, tokens: str
) -> None:
    """Raises :class:`InputMismatchError` for the first input that does not match its spec.

    ``tokens`` says where the call's token count came from (for the message).
    """
    if len(args) != num_inputs:
        raise InputMismatchError(
            f"pp_breakable: {stage} was called with {len(args)} inputs, expected {num_inputs}. {GUARD_HINT}"
        )
    for spec in specs:
        t = args[spec.slot]
        if not isinstance(t, torch.Tensor):
            raise _mismatch(stage, spec, "type", "a tensor", type(t).__name__)
        if t.dtype is not spec.dtype:
            raise _mismatch(stage, spec, "dtype", spec.dtype, t.dtype)
        if t.device != spec.device:
            raise _mismatch(stage, spec, "device", spec.device, t.device)
        shape = t.shape
        if len(shape) != spec.ndim:
            raise _mismatch(stage, spec, "rank", spec.ndim, f"{len(shape)} (shape {list(shape)})")
        for d, size in spec.fixed:
            if shape[d] != size:
                raise _shape_mismatch(stage, spec, shape, env, tokens, specs, args)
        for d, fn in spec.sized:
            if shape[d] != fn(env):
                raise _shape_mismatch(stage, spec, shape, env, tokens, specs, args)


def _mismatch(stage: str, spec: InputSpec, what: str, expected: Any, got: Any) -> InputMismatchError:
    return InputMismatchError(
        f"pp_breakable: input {spec.name!r} of {stage}: expected {what} {expected}, got {got}. {GUARD_HINT}"
    )


def _shape_mismatch(
    stage: str,
    spec: InputSpec,
    shape: torch.Size,
    env: Env,
    tokens: str,
    specs: Sequence[InputSpec],
    args: Sequence[Any],
) -> InputMismatchError:
    want = list(spec.expected_shape(env))
    note = ""
    if spec.sized:
        sized = [
            f"{s.name} {[args[s.slot].shape[d] for d, _ in s.sized]}" for s in specs
            if s.sized and isinstance(args[s.slot], torch.Tensor) and args[s.slot].dim() == s.ndim
        ]
        note = (f" (dims {[d for d, _ in spec.sized]} follow the token count, taken from {tokens}; "
                f"the inputs' token dims: {', '.join(sized)})")
    return InputMismatchError(
        f"pp_breakable: input {spec.name!r} of {stage}: expected shape {want}, got {list(shape)}{note}. "
        f"{GUARD_HINT}"
    )


def storages_of(tensors: Iterable[Any]) -> frozenset[int]:
    """The storage addresses of ``tensors`` (non-tensors skipped)."""
    return frozenset(
        t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor) and t.numel()
    )


def aliased_slots(args: Sequence[Any], slots: Sequence[int], storages: frozenset[int]) -> list[int]:
    """The ``slots`` of ``args`` whose tensor shares a storage with ``storages``."""
    return [
        s for s in slots
        if isinstance(t := args[s], torch.Tensor) and t.untyped_storage().data_ptr() in storages
    ]

"""Debug-mode detection of stale outputs (DESIGN invariant 4).

With ``owned_outputs=False`` (or a ring, ``output_slots``), outputs of a graph-path call are views into
static buffers that a later call of the same compiled stage overwrites. With ``debug=True`` the stage
instance serving the call (``instance.StageInstance``, which owns one :class:`OutputTracker`) hands out
copies instead, and when the next call of that module instance ends it *expires* the previous ones:

* the handed-out tensor object becomes a :class:`StaleOutput`, whose every use (an op, ``repr``,
  ``.shape``, passing it to another compiled stage) raises :class:`StaleOutputError` naming the output
  and the calls involved;
* its memory is filled with a poison value (NaN for floats, the minimum for integers), so a view taken
  from it earlier (``out[:2]``, ``out.detach()``), which is a different tensor object, reads loud garbage
  rather than plausible numbers.

Why this shape: outputs stay plain tensors until they expire, so a valid hand-over to the next compiled
stage looks to Dynamo exactly as without debug (no guard on a subclass, no graph break, no recompile).
A tensor subclass from the start would be traced by the next stage's Dynamo through its
``__torch_function__`` and change what it compiles. Storage-level invalidation
(``torch._C._set_storage_access_error_msg``) only exists in CUDA builds, and version counters are
shared by every view of a storage, so they cannot tell an old view from a new one. Nothing here runs
when ``debug`` is off.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ppcompile.torch_internals import tree_leaves

__all__ = ["OutputTracker", "StaleOutput", "StaleOutputError"]


class StaleOutputError(RuntimeError):
    """An output of a compiled stage was used after the next call of that stage."""


class StaleOutput(torch.Tensor):
    """An expired output (debug mode): any use raises :class:`StaleOutputError`."""

    _pp_stale_message: str

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Iterable[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        stale = next(
            (a for a in tree_leaves((tuple(args), dict(kwargs or {}))) if isinstance(a, StaleOutput)), None
        )
        message = stale.__dict__.get("_pp_stale_message", "") if stale is not None else ""
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
        raise StaleOutputError(f"{message} (used by {name})")


def _poison(t: torch.Tensor) -> None:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        value: float | int = float("nan")
    elif t.dtype == torch.bool:
        return
    else:
        value = torch.iinfo(t.dtype).min
    with torch.inference_mode():  # inference tensors may only be written inside it; others may too
        t.fill_(value)


class OutputTracker:
    """The outputs one module instance handed out, expired when the ``lifetime``-th call after them ends
    (``output_slots``: 1, the next call)."""

    def __init__(self, stage: str, lifetime: int = 1) -> None:
        self.stage = stage
        self.calls = 0
        self.lifetime = lifetime
        # Outputs of the last ``lifetime`` calls, oldest first, each call's as one list.
        self._handed: collections.deque[list[tuple[weakref.ref[torch.Tensor], str]]] = collections.deque()
        self._fresh: list[tuple[weakref.ref[torch.Tensor], str]] = []

    def hand_out(self, outputs: Iterable[tuple[int, torch.Tensor]]) -> None:
        """Records this call's outputs ``(index, tensor)`` (copies the caller owns until the next call)."""
        call = self.calls + 1
        self._fresh = [
            (weakref.ref(t), f"output {i} ({t.dtype}, shape {list(t.shape)}) of call {call}")
            for i, t in outputs
        ]

    def end_call(self) -> None:
        """A call ended (served any way, or failed): expire the outputs of the call ``lifetime`` calls
        before it."""
        self.calls += 1
        self._handed.append(self._fresh)
        self._fresh = []
        while len(self._handed) > self.lifetime:
            self._expire(self._handed.popleft())

    def _expire(self, handed: list[tuple[weakref.ref[torch.Tensor], str]]) -> None:
        valid = "until the next call" if self.lifetime == 1 else f"for {self.lifetime} calls (output_slots)"
        for ref, what in handed:
            t = ref()
            if t is None or isinstance(t, StaleOutput):
                continue
            _poison(t)
            t._pp_stale_message = (  # type: ignore[attr-defined]
                f"pp_breakable debug: stale {what} of {self.stage} used after call {self.calls} of the same "
                f"compiled stage; outputs are valid {valid} (they may be views into static buffers that "
                "later calls overwrite): clone() what you keep longer, or drop owned_outputs=False "
                "(owned copies are the default) or use a larger 'output_slots'"
            )
            t.__class__ = StaleOutput

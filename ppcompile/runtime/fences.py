"""Fences on output ring slots: an engine's PP loop says when a send of a slot was enqueued, and the
stage waits for it before it writes that slot again, with a stream dependency on a GPU.

With ``output_slots=k`` the outputs of forward ``i`` live in ring slot ``i mod k`` until forward ``i + k``
writes it (``graph_path.RingSlots``). An asynchronous send that reads them must be done by then. Instead
of waiting on the host, the loop hands the stage a *fence* for the outputs it is sending::

    out = stage(**inputs)                       # views of slot i mod k
    work = dist.isend(out["hidden_states"], dst)
    ppcompile.fence_outputs(out, work)          # forward i + k waits for work before its ring copy

A fence is whatever the send gave: a ``torch.cuda.Event`` recorded after the send was enqueued (the
compute stream waits on it: no host synchronisation), a ``torch.distributed.Work`` (``wait()``: with
NCCL that orders the current stream after the send; with gloo it blocks the host, the only way on CPU),
or a callable (called). Forward ``i + k`` waits for the slot's fences just before its ring copy, so the
segments before the copy already overlap the send. ``ppcompile.counters.fence_waits`` counts the waits by
kind: ``"event"`` (the current stream waits; the host never blocks), ``"work"`` (``wait()``: a stream
dependency with NCCL, a host block with gloo) and ``"callable"``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from ppcompile.counters import counters
from ppcompile.torch_internals import tree_leaves

__all__ = ["Fence", "FencedSlot", "fence_outputs", "register_slot", "wait_fence"]


class _Waitable(Protocol):
    def wait(self) -> Any: ...


Fence = torch.cuda.Event | _Waitable | Callable[[], Any]


def _kind(fence: object) -> str:
    """``"event"``, ``"work"`` or ``"callable"``; anything else raises."""
    if isinstance(fence, torch.cuda.Event):
        return "event"
    if hasattr(fence, "wait"):
        return "work"
    if callable(fence):
        return "callable"
    raise TypeError(f"fence_outputs: a fence is a torch.cuda.Event, an object with wait() (a "
                    f"torch.distributed.Work) or a callable, got {type(fence).__name__}")


def wait_fence(fence: Fence) -> None:
    """Waits for ``fence`` the cheapest way its kind allows (module docstring) and counts it."""
    kind = _kind(fence)
    if kind == "event":
        torch.cuda.current_stream().wait_event(fence)  # type: ignore[arg-type]
    elif kind == "work":
        fence.wait()  # type: ignore[union-attr]
    else:
        fence()  # type: ignore[operator]
    counters.fence_waits[kind] += 1


class FencedSlot:
    """One ring slot's buffers and the fences its current contents are read by."""

    __slots__ = ("__weakref__", "buffers", "fences")

    def __init__(self, buffers: tuple[torch.Tensor, ...]) -> None:
        self.buffers = buffers
        self.fences: list[Fence] = []

    def claim(self) -> tuple[torch.Tensor, ...]:
        """Waits for the sends still reading this slot; returns its buffers, free to write."""
        fences, self.fences = self.fences, []
        for fence in fences:
            wait_fence(fence)
        return self.buffers


# Storage address -> the slot holding it. Weak: a slot goes with its instance.
_slots: weakref.WeakValueDictionary[int, FencedSlot] = weakref.WeakValueDictionary()
_lock = threading.Lock()


def register_slot(slot: FencedSlot) -> None:
    """Makes ``slot``'s buffers known to :func:`fence_outputs`."""
    with _lock:
        for t in slot.buffers:
            _slots[t.untyped_storage().data_ptr()] = slot


def fence_outputs(outputs: Any, *fences: Fence) -> int:
    """Declares that ``fences`` must complete before the stage writes the memory of ``outputs`` again.

    ``outputs``: what a compiled stage with ``output_slots`` >= 2 returned (any pytree of tensors).
    Returns how many ring slots were fenced: 0 when no output lives in a ring (owned outputs, eager-path
    or debug-mode copies, or ``output_slots=1``, whose graph memory the next call overwrites: wait for the
    send before that call instead).
    """
    if not fences:
        raise ValueError("fence_outputs: give at least one fence (an event, a Work or a callable)")
    for fence in fences:
        _kind(fence)  # refuses what is no fence before any slot holds it
    found = _slots_of(tree_leaves(outputs))
    for slot in found:
        slot.fences.extend(fences)
    return len(found)


def _slots_of(leaves: Iterable[Any]) -> list[FencedSlot]:
    found: list[FencedSlot] = []
    with _lock:
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                slot = _slots.get(t.untyped_storage().data_ptr())
                if slot is not None and all(slot is not s for s in found):
                    found.append(slot)
    return found

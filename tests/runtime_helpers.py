"""Test helpers on the runtime's public seams: the runtime serving a compiled module, and executors that
inject faults at capture, handed to runtimes through their executor seam (no class is patched).

    hooks = CaptureHooks(on_capture=fail_at_bucket(8))
    with hooks.injected():           # every runtime the backend builds meanwhile makes its executors so
        c(*inputs)                   # its first call builds the runtime; the capture at bucket 8 raises

``hooks.factory`` is an ``executors.ExecutorFactory``: ``StageRuntime(compiled, config, executor=...)``
takes it for a runtime a test builds itself; ``injected()`` sets it on each runtime the backend builds,
before its first capture (``runtime.use_executor``, from a ``StageHooks(built=...)`` observer).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

import ppcompile
from ppcompile.observe.hooks import StageHooks, observe_stages
from ppcompile.runtime.executors import (
    EXECUTORS,
    ExecutorFactory,
    GraphExecutor,
    Key,
    OutputShapes,
    OutputStrides,
    SegmentFn,
)
from ppcompile.runtime.group_agreement import Agreement
from ppcompile.runtime.stage_runtime import StageRuntime

__all__ = ["CaptureHooks", "executors_made_by", "fail_at_bucket", "symbolic_runtime"]


def symbolic_runtime(module: torch.nn.Module) -> StageRuntime:
    """The newest runtime serving ``module`` (or what ``torch.compile`` returned for it) whose token count
    is symbolic (Dynamo compiles a 1-token call into a static graph of its own)."""
    runtimes = [rt for rt in ppcompile.runtimes_of(module) if rt.token_symbol is not None]
    assert runtimes, f"no symbolic stage runtime serves {type(module).__name__}"
    return runtimes[-1]


class CaptureHooks:
    """What the executors made by :meth:`factory` do at each capture, before the real one: record the key
    (``keys``), call ``on_capture(key)`` (which may raise: a fault), and capture
    ``segment(key, fn)`` instead of ``fn`` when given. Settable between calls (a fault armed later)."""

    def __init__(self, on_capture: Callable[[Key], None] | None = None,
                 segment: Callable[[Key, SegmentFn], SegmentFn] | None = None) -> None:
        self.on_capture = on_capture
        self.segment = segment
        self.keys: list[Key] = []
        self.executors: list[GraphExecutor] = []

    def factory(self, mode: str, debug: bool, device: torch.device | None,
                agreement: Agreement) -> GraphExecutor:
        cls = _hooked(EXECUTORS[mode])
        executor = cls(debug, device=device, agreement=agreement) if mode == "cuda" else cls(debug, agreement)
        executor.hooks = self  # type: ignore[attr-defined]
        self.executors.append(executor)
        return executor

    @contextlib.contextmanager
    def injected(self) -> Iterator[CaptureHooks]:
        """While open, every stage runtime the backend builds makes its executors with :meth:`factory`."""
        with executors_made_by(self.factory):
            yield self


@contextlib.contextmanager
def executors_made_by(factory: ExecutorFactory) -> Iterator[None]:
    """While open, every stage runtime the backend builds makes its executors with ``factory`` (set before
    its first capture by an observer of built stages; the runtime keeps it after the block)."""
    remove = observe_stages(StageHooks(built=lambda runtime: runtime.use_executor(factory)))
    try:
        yield
    finally:
        remove()


_HOOKED: dict[type[GraphExecutor], type[GraphExecutor]] = {}


def _hooked(base: type[GraphExecutor]) -> type[GraphExecutor]:
    """``base`` with its capture preceded by its ``hooks`` (one subclass per executor class)."""
    cls = _HOOKED.get(base)
    if cls is None:

        def capture(self: Any, key: Key, fn: SegmentFn, args: Sequence[Any],
                    shapes: OutputShapes | None = None, strides: OutputStrides | None = None,
                    ) -> tuple[Any, ...]:
            hooks: CaptureHooks = self.hooks
            hooks.keys.append(key)
            if hooks.on_capture is not None:
                hooks.on_capture(key)
            if hooks.segment is not None:
                fn = hooks.segment(key, fn)
            return base.capture(self, key, fn, args, shapes, strides)

        cls = _HOOKED[base] = type(f"Hooked{base.__name__}", (base,), {"capture": capture})
    return cls


def fail_at_bucket(bucket: int, error: Callable[[str], BaseException] = RuntimeError,
                   message: str | None = None) -> Callable[[Key], None]:
    """An ``on_capture`` that fails every capture at ``bucket`` with ``error(message)``."""
    def fail(key: Key) -> None:
        if key[1] == bucket:
            raise error(message or f"no memory for bucket {bucket}")

    return fail

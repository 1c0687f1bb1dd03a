"""Inductor-compiled segments a warm restart can store, so its lowered stage need not compile again.

While ``warm_compile`` compiles a stage (:func:`storing_kernels`), each Inductor compile of a segment
keeps the cache artifacts torch wrote or read for it (``torch.compiler.save_cache_artifacts``: the
compiled code and its AOTAutograd entry) and that entry's key, on a :class:`StoredKernel` that calls
the compiled function. ``stored_stage`` writes a ``StoredKernel`` as those bytes and that key; reading
it back puts the artifacts in Inductor's caches and loads the function by its key: no graph, no trace,
no cache-key computation. A compile whose artifacts torch did not record (its caches off) is a plain
callable, and a stage holding one is stored as its Dynamo graph only.

Outside ``warm_compile`` segments compile as they always do (no recording, no wrapper).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ppcompile.torch_internals.precompile import compile_recording, load_recorded

__all__ = ["StoredKernel", "load_kernel", "storable_compile", "storing_kernels"]

_STORING: contextvars.ContextVar[bool] = contextvars.ContextVar("ppcompile_storing_kernels", default=False)


@contextlib.contextmanager
def storing_kernels() -> Iterator[None]:
    """Inside, :func:`storable_compile` records what it compiles."""
    token = _STORING.set(True)
    try:
        yield
    finally:
        _STORING.reset(token)


class StoredKernel:
    """A compiled segment with the cache artifacts and AOTAutograd key it loads from elsewhere.
    ``single_output``: its graph returns one value, not a tuple (a loaded function returns its outputs
    as a list, so the kernel unwraps the one value, as the function ``compile_fx`` returned did)."""

    __slots__ = ("artifacts", "fn", "key", "single_output")

    def __init__(self, fn: Callable[..., Any], artifacts: bytes, key: str, single_output: bool) -> None:
        self.fn, self.artifacts, self.key, self.single_output = fn, artifacts, key, single_output

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


def _returns_one_value(gm: torch.fx.GraphModule) -> bool:
    (output,) = gm.graph.find_nodes(op="output")
    return not isinstance(output.args[0], (tuple, list))


def storable_compile(gm: torch.fx.GraphModule,
                     compile: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
    """``compile()`` (Inductor's compile of ``gm``); inside :func:`storing_kernels`, a
    :class:`StoredKernel` when torch recorded its artifacts."""
    if not _STORING.get():
        return compile()
    single = _returns_one_value(gm)  # before the compile, which may make the graph return a tuple
    fn, recorded = compile_recording(compile)
    return fn if recorded is None else StoredKernel(fn, *recorded, single)


def load_kernel(artifacts: bytes, key: str, single_output: bool) -> StoredKernel:
    """The kernel a :class:`StoredKernel` was written as (``stored_stage``), loaded in this process."""
    loaded = load_recorded(artifacts, key)
    if not single_output:
        return StoredKernel(loaded, artifacts, key, single_output)

    def first(*args: Any) -> Any:
        (out,) = loaded(*args)
        return out

    return StoredKernel(first, artifacts, key, single_output)

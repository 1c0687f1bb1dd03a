"""A stage frame whose recompile failed (a bad input: tracing raised the model's own error) is compiled
again, instead of running uncompiled from then on.

When Dynamo cannot compile a frame, it runs that call uncompiled and marks the frame's code to run
uncompiled for good, even though the frame's earlier graphs still match good inputs. A stage called once
with a bad input (a missing proxy key makes the model raise while Dynamo traces it) would then run every
later call as the functions its forward calls, each compiled on its own: several stage graphs per forward,
each capturing its buckets. So:

* the end of every Dynamo compile is watched; a recompile of a stage frame that raised and reached no
  backend call (the trace raised) is reported once (a warning, ``counters.input_recompiles``);
* at the next Dynamo compile, or the next call of a graph compiled inside that uncompiled call, the frame
  is turned back on (``torch_internals.frames.compile_again``): its next call is served by its stage
  graphs again;
* a graph Dynamo compiles for a function the uncompiled stage frame calls gets no stage runtime of its own
  (no capture): it runs as traced, and turns the frame back on when it runs.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import torch

from ppcompile.counters import counters
from ppcompile.torch_internals import dynamo_generation, recompile_limit
from ppcompile.torch_internals.frames import compile_again, compiling_code, watch_compiles

__all__ = ["inside_a_recovered_stage", "note_backend_call", "note_stage_frame", "passthrough"]

log = logging.getLogger(__name__)

_COMPILE_ID = re.compile(r"(\d+)/(\d+)")
_lock = threading.Lock()
_stage_frames: dict[int, tuple[types.CodeType, str]] = {}  # frame id -> its code, its first stage graph
_reached_backend: set[tuple[int, int]] = set()  # (frame, compile) pairs that called the backend
_pending: dict[int, types.CodeType] = {}  # frames Dynamo gave up on, to turn back on
_recovered: set[types.CodeType] = set()  # codes turned back on: graphs compiled under them pass through
_warned: set[int] = set()
_watching = False
_generation = -1  # frame ids restart at torch._dynamo.reset(), which also drops the compile callbacks


def _forget_an_older_generation() -> None:
    global _generation, _watching
    generation = dynamo_generation()
    if generation != _generation:
        _generation, _watching = generation, False
        for state in (_stage_frames, _reached_backend, _pending, _recovered, _warned):
            state.clear()


def _parse(compile_id: str) -> tuple[int, int] | None:
    match = _COMPILE_ID.search(compile_id)
    return (int(match[1]), int(match[2])) if match else None


def note_stage_frame(frame: int | None, stage: str) -> None:
    """A stage graph was compiled for frame ``frame``: its code is watched from now on."""
    code = compiling_code()
    if frame is None or code is None:
        return
    global _watching
    with _lock:
        _forget_an_older_generation()
        _stage_frames.setdefault(frame, (code, stage))
        if not _watching:
            watch_compiles(_on_start, _on_end)
            _watching = True


def note_backend_call(frame: int | None, compile_index: int | None) -> None:
    """The backend is compiling a graph for ``frame``'s ``compile_index``-th compile."""
    if frame is not None and compile_index is not None:
        with _lock:
            _forget_an_older_generation()
            _reached_backend.add((frame, compile_index))


def _on_end(compile_id: str, failed: bool) -> None:
    ids = _parse(compile_id)
    if not failed or ids is None or ids[1] == 0 or ids[1] >= recompile_limit():
        # A compile that ended well and never called this backend compiled for another one (the stage
        # compiled with backend="eager" beside, say); at the limit Dynamo's choice stands.
        return
    with _lock:
        _forget_an_older_generation()
        frame = _stage_frames.get(ids[0])
        if frame is None or ids in _reached_backend:
            return
        _pending[ids[0]] = frame[0]
        warn = ids[0] not in _warned
        _warned.add(ids[0])
    counters.input_recompiles += 1
    code, stage = frame
    if warn:
        log.warning(
            "pp_breakable: Dynamo could not recompile the frame of %s (%s, %s:%d) for a call: tracing it "
            "raised, most likely the model's own error for a bad input (a missing proxy key, say), which "
            "the call raised. ppcompile has the frame compiled again, so later good calls are served by "
            "its stage graphs; fix that call's inputs", stage, code.co_name, code.co_filename,
            code.co_firstlineno)


def _on_start(_: str) -> None:
    _turn_pending_back_on()


def _turn_pending_back_on() -> None:
    if not _pending:
        return
    with _lock:
        pending = list(_pending.values())
        _pending.clear()
        _recovered.update(pending)
    for code in pending:
        compile_again(code)


def inside_a_recovered_stage() -> bool:
    """Whether a stage frame that Dynamo gave up on is running uncompiled below this call (the backend is
    compiling a function it calls)."""
    if not _recovered and not _pending:
        return False
    codes = _recovered | set(_pending.values())
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def passthrough(gm: torch.fx.GraphModule) -> Callable[..., Any]:
    """What the backend returns for a graph compiled inside an uncompiled stage frame: the graph as
    traced; running it turns a pending frame back on."""
    forward = gm.forward

    def run(*args: Any) -> Any:
        _turn_pending_back_on()
        return forward(*args)

    return run

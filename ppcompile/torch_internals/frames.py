"""Entries of :mod:`ppcompile.torch_internals` on Dynamo's frames: which code a compile is for, the start
and end of every Dynamo compile, turning a frame Dynamo gave up on back on, and where a graph input
comes from (the call's arguments, or state the frame reaches otherwise)."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

from ppcompile.torch_internals.lookup import lookup as _lookup

__all__ = ["compile_again", "compiling_code", "outside_the_call", "watch_compiles"]


def compiling_code() -> types.CodeType | None:
    """The code object of the frame Dynamo is compiling now (called from a backend), or None."""
    translator = _lookup("torch._dynamo.symbolic_convert", "InstructionTranslator",
                         "to tell which frame a stage graph belongs to")
    try:
        code = translator.current_tx().f_code
    except AttributeError:  # no trace in progress on this thread
        return None
    return code if isinstance(code, types.CodeType) else None


def watch_compiles(on_start: Callable[[str], None], on_end: Callable[[str, bool], None]) -> None:
    """Calls ``on_start`` with the compile id (``"0/1"``) at the start of every Dynamo compile of a frame,
    and ``on_end`` with the id and whether the compile raised at its end. Dynamo runs the end callbacks
    while the compile's error propagates (they are the ``finally`` of a context manager around it), so
    the error in flight tells a failed compile from one that handed its graph to another backend."""
    handler = _lookup("torch._dynamo.callback", "callback_handler", "to see compiles that fail")
    handler.register_start_callback(lambda args: on_start(str(_compile_id(args))))
    handler.register_end_callback(lambda args: on_end(str(_compile_id(args)), sys.exc_info()[1] is not None))


def _compile_id(args: Any) -> Any:
    return getattr(args, "compile_id", "")


def compile_again(code: types.CodeType) -> None:
    """Undoes Dynamo's decision to run ``code`` uncompiled from now on (it makes it when a compile of the
    frame fails): its next call looks up its compiled graphs again, and compiles on a miss."""
    why = "to compile a frame again after a failed recompile"
    strategy = _lookup("torch._C._dynamo.eval_frame", "_FrameExecStrategy", why)
    action = _lookup("torch._C._dynamo.eval_frame", "_FrameAction", why)
    _lookup("torch._C._dynamo.eval_frame", "set_code_exec_strategy", why)(
        code, strategy(action.DEFAULT, action.DEFAULT))


def outside_the_call(source: Any) -> bool:
    """Whether a graph input's Dynamo source lies outside the call's arguments: a global, a closure cell
    (or another local that is no input), or anything reached through an ``nn.Module`` (a parameter, a
    buffer, a plain tensor attribute). A stand-in that carries the answer (``outside_call``, as the warm
    restarts' graph codec stores it) gives it. Dynamo's source classes are read by name along ``base``."""
    known = getattr(source, "outside_call", None)
    if isinstance(known, bool):
        return known
    node = source
    while node is not None:
        kind = type(node).__name__
        if "NNModule" in kind or kind.startswith("Global"):
            return True
        if kind == "LocalSource":
            cell = bool(getattr(node, "is_derefed_cell_contents", False))
            return cell or not getattr(node, "is_input", True)
        node = getattr(node, "base", None)
    return False

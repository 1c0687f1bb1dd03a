"""Where dumps go and how they are written: files under the dump dir, and ``TORCH_TRACE`` artifacts.

Layout, per process (``rank_<r>/`` only when ``torch.distributed`` is initialised)::

    <dump_dir>/[rank_<r>/]<stage graph>/
        00.dynamo_graph.py          the graph Dynamo handed to the backend
        NN.<pass name>.py           the graph after pass NN, only when that pass changed it
        split_module.py             the final split module (segments as nested classes)
        segments/NN.<name>.<kind>.py  each segment's code (kind: graph | break)
        runtime_code.txt            the code the runtime generated for each call (runtime/codegen.py)
        report.json, report.html    the stage report (rewritten after capture and at exit)

Every ``.py`` file runs with ``python FILE`` (see :mod:`ppcompile.observe.runnable`): its graph on random
inputs, or, where the harness cannot run it (an engine's own attention), a message saying why. The same
text is emitted through ``torch._logging.trace_structured("artifact", ...)``, so ``TORCH_TRACE=dir`` +
``tlparse`` show it; the text is only built when a trace handler is installed.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from ppcompile.observe.runnable import runnable_source
from ppcompile.torch_internals import trace_artifact

__all__ = ["distributed_rank", "emit_artifact", "reset_stage_dir", "stage_dir", "write_graph", "write_text"]

log = logging.getLogger(__name__)

ARTIFACT_PREFIX = "ppcompile"


def distributed_rank() -> int | None:
    """This process's ``torch.distributed`` rank, or None when torch.distributed is not initialised."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def stage_dir(dump_dir: str, graph_name: str) -> str:
    """The folder of one stage graph's dumps (with a ``rank_<r>`` level under torch.distributed)."""
    rank = distributed_rank()
    if rank is None:
        return os.path.join(dump_dir, graph_name)
    return os.path.join(dump_dir, f"rank_{rank}", graph_name)


def reset_stage_dir(folder: str) -> None:
    """Removes the dumps a previous compile of the same stage graph left (only files this module writes)."""
    patterns = ("[0-9][0-9].*.py", "split_module.py", "segments/[0-9][0-9].*.py", "runtime_code.txt",
                "report.json", "report.html")
    for pattern in patterns:
        for path in glob.glob(os.path.join(glob.escape(folder), pattern)):
            os.remove(path)


def write_text(folder: str, filename: str, text: str) -> str:
    """Writes ``text`` to ``folder/filename`` (creating folders) atomically; returns the path."""
    path = os.path.join(folder, filename)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


def emit_artifact(
    name: str, payload_fn: Callable[[], str], encoding: str = "string", compile_id: Any = None
) -> None:
    """Emits ``payload_fn()`` as a ``trace_structured`` artifact named ``ppcompile_<name>``.

    Costs one function call when no trace handler is installed (``payload_fn`` is not called then).
    """
    trace_artifact(lambda: {"name": f"{ARTIFACT_PREFIX}_{name}", "encoding": encoding}, payload_fn,
                   compile_id)


def write_graph(
    dump_dir: str | None, graph_name: str, filename: str, gm: torch.fx.GraphModule, title: str
) -> str | None:
    """Writes ``gm`` as a runnable file ``<stage dir>/<filename>`` when dumping, and emits it as an
    artifact either way; returns the path written, if any."""
    source: list[str] = []

    def text() -> str:
        if not source:
            source.append(runnable_source(gm, f"{title} of {graph_name}"))
        return source[0]

    artifact = filename.removesuffix(".py").replace("/", "_").replace(".", "_")
    emit_artifact(artifact, text)
    if dump_dir is None:
        return None
    return write_text(stage_dir(dump_dir, graph_name), filename, text())

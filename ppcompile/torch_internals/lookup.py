"""The lookups every entry of :mod:`ppcompile.torch_internals` goes through: a missing API fails loudly."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch

__all__ = ["TorchInternalsError", "attr", "lookup", "missing"]


class TorchInternalsError(RuntimeError):
    """The installed torch lacks a private API ppcompile relies on."""


def missing(name: str, why: str) -> TorchInternalsError:
    return TorchInternalsError(
        f"ppcompile: torch {torch.__version__} has no {name}, which ppcompile uses {why}. ppcompile "
        "supports torch>=2.11; install a supported torch, or report this torch version as unsupported"
    )


def attr(obj: Any, path: str, owner: str, why: str) -> Any:
    """``obj.<path>`` (dotted), or a :class:`TorchInternalsError` naming ``owner.<path>``."""
    for part in path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise missing(f"{owner}.{path}", why) from e
    return obj


def lookup(module: str, path: str, why: str) -> Any:
    """``module.<path>`` as it is now (read per call, so a patched attribute is seen); a missing module
    or attribute raises, naming it."""
    mod = sys.modules.get(module)  # imported already: import_module's own lookup costs a few us a call
    if mod is None:
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            raise missing(f"module {module}", why) from e
    return attr(mod, path, module, why)

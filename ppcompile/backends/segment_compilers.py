"""Segment compilers: turn one FX segment into a callable.

* ``eager``: the segment's own FX code, run as is.
* ``inductor``: ``compile_fx`` over the segment's symbolic example inputs, so one compile serves every
  bucket and the live sizes break segments see.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ppcompile.symbolic import example_value

__all__ = ["compile_segment"]

log = logging.getLogger(__name__)


def _example_inputs(gm: torch.fx.GraphModule) -> list[Any]:
    return [example_value(p) for p in gm.graph.find_nodes(op="placeholder")]


def compile_segment(gm: torch.fx.GraphModule, compiler: str) -> Callable[..., Any]:
    """Compiles one graph segment with the named segment compiler."""
    if compiler == "eager":
        return gm
    if compiler == "inductor":
        from torch._inductor.compile_fx import compile_fx

        compiled: Callable[..., Any] = compile_fx(gm, _example_inputs(gm))  # type: ignore[assignment]
        return compiled
    raise ValueError(f"pp_breakable: unknown segment compiler {compiler!r}; valid: 'eager' | 'inductor'")

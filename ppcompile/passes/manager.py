"""Runs the passes in order: times, logs and (when asked) dumps each; reports a failing pass by name.

The order is the tuple ``PASSES`` below, one comment per entry saying why it sits there.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

from ppcompile.passes.align_global_layers import align_global_layers
from ppcompile.passes.check_padding_safety import check_padding_safety
from ppcompile.passes.context import PassContext, PassResult
from ppcompile.passes.find_token_dims import find_token_dims
from ppcompile.passes.lift_static_inputs import lift_static_inputs
from ppcompile.passes.plan_output_trim import plan_output_trim
from ppcompile.passes.split_at_breaks import split_at_breaks

__all__ = ["PASSES", "PassError", "run_passes"]

log = logging.getLogger(__name__)

Pass = Callable[[torch.fx.GraphModule, PassContext], PassResult]

PASSES: tuple[Pass, ...] = (
    # Every later pass reasons about token dims: find the token symbol and annotate shapes first.
    find_token_dims,
    # Needs nothing but the flat graph; must see attention calls before they are split apart.
    align_global_layers,
    # Needs token dims (it judges ops by which of their dims scale with tokens); must run before the
    # split, which turns the nodes it flags into breaks.
    check_padding_safety,
    # Needs token dims (non-token shapes are breaks), layer ids (recorded on break segments) and the
    # padding-safety verdicts.
    split_at_breaks,
    # Needs the segments: only inputs that graph segments read are lifted.
    lift_static_inputs,
    # Needs the split graph's outputs and their token dims.
    plan_output_trim,
)


class PassError(RuntimeError):
    """A pass failed; the message names the pass and the stage graph."""


def _dump(gm: torch.fx.GraphModule, ctx: PassContext, index: int, name: str) -> None:
    assert ctx.config.dump_dir is not None
    folder = os.path.join(ctx.config.dump_dir, ctx.graph_name)
    os.makedirs(folder, exist_ok=True)
    code = gm.print_readable(print_output=False, include_stride=False, include_device=False)
    with open(os.path.join(folder, f"{index:02d}.{name}.py"), "w") as f:
        f.write(f"# ppcompile: graph after pass {name!r} of {ctx.graph_name}\nimport torch\n\n{code}\n")


def run_passes(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Runs ``PASSES`` in order and returns the final (split) graph module."""
    if ctx.config.dump_dir is not None:
        _dump(gm, ctx, 0, "dynamo_graph")
    for index, p in enumerate(PASSES, start=1):
        start = time.perf_counter()
        try:
            result = p(gm, ctx)
        except ValueError:
            raise
        except Exception as e:
            raise PassError(
                f"pp_breakable: pass {p.__name__!r} failed on {ctx.graph_name}: {type(e).__name__}: {e}"
                + (f" (input graph dumped under {ctx.config.dump_dir})" if ctx.config.dump_dir else "")
            ) from e
        ctx.pass_times[p.__name__] = time.perf_counter() - start
        log.debug("%s: pass %s took %.1f ms (modified=%s)", ctx.graph_name, p.__name__,
                  1e3 * ctx.pass_times[p.__name__], result.modified)
        gm = result.graph_module
        if result.modified and ctx.config.dump_dir is not None:
            _dump(gm, ctx, index, p.__name__)
    return gm

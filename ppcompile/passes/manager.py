"""Runs the passes in order: times, logs and (when asked) dumps each; reports a failing pass by name.

The order is the tuple ``PASSES`` below, one comment per entry saying why it sits there. ``run_passes`` takes
another tuple by argument (a test leaves a pass out, or adds one that fails).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from ppcompile.analysis.node_facts import SEGMENT
from ppcompile.observe.dumps import reset_stage_dir, stage_dir, write_graph
from ppcompile.observe.progress import Progress
from ppcompile.passes.align_global_layers import align_global_layers
from ppcompile.passes.check_capture_safety import check_capture_safety
from ppcompile.passes.check_padding_safety import check_padding_safety
from ppcompile.passes.context import PassContext, PassResult
from ppcompile.passes.expand_stamped_layers import expand_stamped_layers
from ppcompile.passes.find_collectives import find_collectives
from ppcompile.passes.find_declared_regions import find_declared_regions
from ppcompile.passes.find_token_dims import find_token_dims
from ppcompile.passes.inline_nested_regions import inline_nested_regions
from ppcompile.passes.lift_static_inputs import lift_static_inputs
from ppcompile.passes.split_at_breaks import split_at_breaks
from ppcompile.passes.tensorify_float_attributes import tensorify_float_attributes
from ppcompile.torch_internals import restart_analysis

__all__ = ["PASSES", "PassError", "run_passes"]

log = logging.getLogger(__name__)

Pass = Callable[[torch.fx.GraphModule, PassContext], PassResult]

PASSES: tuple[Pass, ...] = (
    # Inductor segments only. First: it may ask Dynamo to re-trace, which throws away any work before it;
    # it reads the float inputs as Dynamo passes them.
    tensorify_float_attributes,
    # Every later pass reasons about single ops: put the ops of nested compile regions (traced once,
    # called per layer) back into the stage graph first.
    inline_nested_regions,
    # Same reason: stamped layers (traced as one op each) get their exemplar's ops back.
    expand_stamped_layers,
    # Every later pass reasons about token dims: find the token symbol and annotate shapes first.
    find_token_dims,
    # Needs nothing but the flat graph; must see attention calls before they are split apart.
    align_global_layers,
    # Reads only Dynamo's node meta; must run before the padding-safety check, which trusts what it finds.
    find_declared_regions,
    # Needs token dims (a collective along the token dim moves rows between ranks); must run before
    # both safety checks, which take its verdicts on collectives instead of their op rules.
    find_collectives,
    # Needs token dims (it judges ops by which of their dims scale with tokens); must run before the
    # split, which turns the nodes it flags into breaks.
    check_padding_safety,
    # Needs token dims (it probes custom ops at their traced sizes) and only node meta; before the split,
    # which turns the nodes it flags into breaks.
    check_capture_safety,
    # Needs token dims (non-token shapes are breaks), layer ids (recorded on break segments) and the
    # padding-safety verdicts.
    split_at_breaks,
    # Needs the segments: only inputs that graph segments read are lifted.
    lift_static_inputs,
)


class PassError(RuntimeError):
    """A pass failed; the message names the pass and the stage graph."""


def _dump(gm: torch.fx.GraphModule, ctx: PassContext, index: int, name: str) -> None:
    """``NN.<pass>.py`` under the stage's dump folder (when dumping) and a ``TORCH_TRACE`` artifact."""
    what = "graph Dynamo handed to the backend" if index == 0 else f"graph after pass {name!r}"
    write_graph(ctx.config.dump_dir, ctx.graph_name, f"{index:02d}.{name}.py", gm, what)


def run_passes(
    gm: torch.fx.GraphModule, ctx: PassContext, passes: Sequence[Pass] = PASSES
) -> torch.fx.GraphModule:
    """Runs ``passes`` (the manager's ``PASSES`` unless given) in order and returns the final graph module
    (the split one, after ``PASSES``)."""
    if ctx.config.dump_dir is not None:
        reset_stage_dir(stage_dir(ctx.config.dump_dir, ctx.graph_name))
    _dump(gm, ctx, 0, "dynamo_graph")
    progress = Progress(f"pp_breakable compile {ctx.graph_name}", len(passes), "passes")
    for index, p in enumerate(passes, start=1):
        start = time.perf_counter()
        try:
            result = p(gm, ctx)
        except restart_analysis():
            progress.abort()
            raise  # Dynamo's own protocol: it re-traces and calls the backend again
        except ValueError:
            progress.abort()
            raise
        except Exception as e:
            progress.abort()
            raise PassError(
                f"pp_breakable: pass {p.__name__!r} failed on {ctx.graph_name}: {type(e).__name__}: {e}"
                + (f" (input graph dumped under {ctx.config.dump_dir})" if ctx.config.dump_dir else "")
            ) from e
        ctx.pass_times[p.__name__] = time.perf_counter() - start
        log.debug("%s: pass %s took %.1f ms (modified=%s)", ctx.graph_name, p.__name__,
                  1e3 * ctx.pass_times[p.__name__], result.modified)
        gm = result.graph_module
        if result.modified:
            _dump(gm, ctx, index, p.__name__)
        progress.advance(note=p.__name__)
    slowest = max(ctx.pass_times, key=ctx.pass_times.__getitem__, default="-")
    progress.finish(f"{len(passes)} passes in {progress.elapsed_s:.2f} s (slowest {slowest}: "
                    f"{1e3 * ctx.pass_times.get(slowest, 0.0):.1f} ms), {_segment_count(gm)} segments")
    return gm


def _segment_count(gm: torch.fx.GraphModule) -> int:
    return sum(1 for node in gm.graph.find_nodes(op="call_module") if SEGMENT.has(node))

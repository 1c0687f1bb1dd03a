"""Pass ``check_capture_safety``: find the ops a CUDA graph cannot capture, so they run as breaks.

Every call node is judged by ``analysis.capture_rules`` (host reads, data-dependent output sizes, host
and device copies, private generators, custom ops whose implementation does one of these); reading a
Python number Dynamo passes as a 0-d CPU tensor (a norm's ``eps``) is no host read. A node that
fails gets ``meta["pp_capture_unsafe"]`` with the reason, and ``split_at_breaks`` makes it a break that
runs eagerly on live rows (attention and ``split_ops`` are breaks already and are not judged: a custom
op is probed by running its Python implementation once on fake tensors, at compile time). Collectives
are not judged either: a capture-safe communicator (NCCL) records them into the graph, and probing a
declared collective op would communicate from one rank. Inside a
declared token-local region the whole region becomes that break (its inner values are not token-major).
The verdict does not depend on the graph mode or the segment
compiler: a stage splits the same way on the CPU emulation as on a GPU, so one that runs on CPU does not
fail capture on a GPU for an op reason.

Before (``s0`` tokens; ``mylib.grouped_mm`` reads its offsets with ``offs.tolist()``)::

    sort = torch.sort(expert_ids)                       # a token-local MoE block
    mm = torch.ops.mylib.grouped_mm(x_sorted, w, offs)
    scatter = ...

After (same code)::

    mm.meta["pp_capture_unsafe"] == "its implementation reads a device value on the host (a sync)"
    # split_at_breaks: the MoE block, sort to scatter, is one break
"""

from __future__ import annotations

import logging

import torch

from ppcompile.analysis.capture_rules import CaptureRules
from ppcompile.analysis.node_facts import CAPTURE_UNSAFE, COLLECTIVE
from ppcompile.analysis.op_matching import OpMatcher, always_split_ops, op_name
from ppcompile.errors import source_line
from ppcompile.passes.context import PassContext, PassResult
from ppcompile.records import InputKind

__all__ = ["check_capture_safety"]

log = logging.getLogger(__name__)


def check_capture_safety(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Marks nodes that CUDA graph capture rejects ``meta["pp_capture_unsafe"]``."""
    if ctx.token_symbol is None:
        return PassResult(gm, modified=False)  # the stage runs eagerly as a whole
    scalars = (InputKind.CONSTANT_SCALAR, InputKind.SCALAR_ARG)
    rules = CaptureRules(p for p, kind in zip(gm.graph.find_nodes(op="placeholder"), ctx.input_kinds)
                         if kind in scalars)
    breaks = OpMatcher([*always_split_ops(), *ctx.config.split_ops])
    for node in gm.graph.nodes:
        if breaks.matches(node) or COLLECTIVE.has(node):
            continue  # a break already, or a collective (probing it would communicate): not probed
        why = rules.problem(node)
        if why is None:
            continue
        label = f"Tensor.{op_name(node)}" if node.op == "call_method" else op_name(node, qualified=True)
        CAPTURE_UNSAFE.set(node, why)
        log.info("%s: %s %s at %s: runs eagerly (capture safety)", ctx.graph_name, label, why,
                 source_line(node))
    return PassResult(gm, modified=False)

"""Pass ``align_global_layers``: map each attention call to its global layer id; judge eligibility.

A PP stage owns layers ``[start, end)`` of the model, and its attention ops index KV caches by *global*
layer id. The stage is graph-eligible when its local attention layers are unique and contiguous: the
judgement is made on the local stage only, never against the model's total layer count (comparing
with the total is the bug that disabled graphs on every PP stage before the seed change).

Before::

    q_3 = ...;  attention_3 = torch.ops.ppcompile.attention(q_3, k_3, v_3, 4)
    q_4 = ...;  attention_4 = torch.ops.ppcompile.attention(q_4, k_4, v_4, 5)

After (same code)::

    attention_3.meta["pp_layer_id"] == 4;  attention_4.meta["pp_layer_id"] == 5
    ctx.layer_ids == (4, 5);  ctx.eligible is True

Duplicate ids raise ``ValueError`` (two layers would share one KV cache). A gap (e.g. ids 4, 6: the
layer between has no standard attention) makes the stage ineligible: it runs eagerly, with the reason.
"""

from __future__ import annotations

import logging

import torch

from ppcompile.analysis.node_facts import LAYER_ID
from ppcompile.analysis.op_matching import attention_layer_id
from ppcompile.passes.context import PassContext, PassResult

__all__ = ["align_global_layers"]

log = logging.getLogger(__name__)


def align_global_layers(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Records ``meta["pp_layer_id"]`` on attention nodes and fills ``ctx.layer_ids`` / ``eligible``."""
    seen: dict[int, torch.fx.Node] = {}
    inputs = dict(zip(gm.graph.find_nodes(op="placeholder"), ctx.example_inputs))
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        layer_id = attention_layer_id(node, inputs)
        if layer_id is None:
            continue
        if layer_id in seen:
            raise ValueError(
                f"pp_breakable: global layer id {layer_id} is used by two attention calls "
                f"({seen[layer_id].name} and {node.name}) in {ctx.graph_name}; each layer needs its own id"
            )
        seen[layer_id] = node
        LAYER_ID.set(node, layer_id)
    ids = tuple(sorted(seen))
    ctx.layer_ids = ids
    if ids and ids != tuple(range(ids[0], ids[-1] + 1)):
        missing = sorted(set(range(ids[0], ids[-1] + 1)) - set(ids))
        ctx.eligible = False
        ctx.ineligible_reason = (
            f"local attention layers {ids[0]}..{ids[-1]} are not contiguous (no attention op for "
            f"global layer(s) {missing}); the stage runs eagerly"
        )
        log.warning("%s: %s", ctx.graph_name, ctx.ineligible_reason)
    elif ids:
        log.debug("%s: local attention layers %d..%d (%d)", ctx.graph_name, ids[0], ids[-1], len(ids))
    return PassResult(gm, modified=False)

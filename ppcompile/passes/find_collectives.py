"""Pass ``find_collectives``: which nodes are collectives, on which group, and may they see padding.

A tensor-parallel stage all-reduces after its row-parallel projections and may gather its logits.
This pass records each collective (Dynamo's ``_c10d_functional`` ops, and the engine-style custom ops
of the ``collective_ops`` option) as ``meta["pp_collective"]`` (a ``records.Collective``: the op, the
c10d group it names, and why it moves token rows, if it does) and lists them in ``ctx.collectives``.
The rules are ``analysis.collectives``: all-reduces and broadcasts are token-local, as are gathers and
reduce-scatters along a non-token dim (the chunk and cat around them share their fact); along the token
dim they are not. ``check_padding_safety`` takes these verdicts instead of its op rules, so token-local
collectives stay in graph segments and the others become breaks; ``check_capture_safety`` does not
probe them (their implementations communicate). The runtime agrees its decisions across the group the
collectives name (``tp_group``; ``runtime/group_agreement.py``).

Before (``s0`` tokens; ``dist.all_reduce(y)`` on a row-parallel output)::

    y = torch._C._nn.linear(l_x_, l_w_)
    tensor = torch.ops._c10d_functional.all_reduce(y, 'sum', '0')
    wait_tensor = torch.ops._c10d_functional.wait_tensor(tensor)
    copy_ = y.copy_(wait_tensor)

After (same code)::

    tensor.meta["pp_collective"] == Collective(op="all_reduce", group="0", unsafe=None)
    wait_tensor.meta["pp_collective"] == Collective(op="wait_tensor", group="0", unsafe=None)
    ctx.collectives == (Collective("all_reduce", "0"),)     # wait_tensor is no collective of its own
"""

from __future__ import annotations

import logging

import torch

from ppcompile.analysis.collectives import find_collective_uses, functional_collective
from ppcompile.analysis.node_facts import COLLECTIVE
from ppcompile.analysis.op_matching import OpMatcher, loaded_ops
from ppcompile.engine_ops import OpRole, names_with_role
from ppcompile.errors import source_line
from ppcompile.passes.context import PassContext, PassResult

__all__ = ["find_collectives"]

log = logging.getLogger(__name__)


def find_collectives(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Records ``meta["pp_collective"]`` on collective nodes and ``ctx.collectives``."""
    declared = OpMatcher([*ctx.config.collective_ops, *loaded_ops(names_with_role(OpRole.ALL_REDUCE))])
    uses = find_collective_uses(gm.graph, declared.matches)
    calls = []
    for node, use in uses.items():
        COLLECTIVE.set(node, use)
        if functional_collective(node) == "wait_tensor" or not (
            functional_collective(node) or declared.matches(node)
        ):
            continue  # a wait, or the chunk/cat around a gather: part of a collective already listed
        calls.append(use)
        verdict = "stays in graph segments" if use.unsafe is None else f"runs eagerly: {use.unsafe}"
        log.debug("%s: collective %s (group %s) at %s %s", ctx.graph_name, use.op, use.group,
                  source_line(node), verdict)
    ctx.collectives = tuple(calls)
    if calls:
        groups = sorted({str(c.group) for c in calls if c.group is not None})
        log.info("%s: %d collective(s) on group(s) %s", ctx.graph_name, len(calls),
                 groups or "(declared ops)")
    return PassResult(gm, modified=False)

"""Which node of a graph segment made its capture fail.

A capture that fails says little of its own: real CUDA capture reports "operation not permitted when
stream is capturing" from whichever op broke it, and a compiled segment hides its ops. The runtime then
runs the segment's FX graph node by node, under the same capture conditions (``GraphExecutor.trial``),
and names the node whose op raised, with its source line::

    capturing segment submod_0 of stage_0 for bucket 16 failed: RuntimeError: ... at node item
    (Tensor.item), File "model.py", line 12, in forward
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ppcompile.errors import source_line

__all__ = ["describe_node", "failing_node"]


class _Tracking(torch.fx.Interpreter):
    """An interpreter that remembers the node it is running."""

    current: torch.fx.Node | None = None

    def run_node(self, n: torch.fx.Node) -> Any:
        self.current = n
        return super().run_node(n)


def failing_node(module: torch.fx.GraphModule, args: Sequence[Any],
                 trial: Callable[[Callable[[], Any]], None]) -> torch.fx.Node | None:
    """The node of ``module`` whose op raises when ``module(*args)`` runs under ``trial``, or None when
    it runs through (the failure was not an op's: an Inductor kernel's, say)."""
    tracking = _Tracking(module)
    try:
        trial(lambda: tracking.run(*args))
    except Exception:
        node = tracking.current
        ran_an_op = node is not None and node.op in ("call_function", "call_method", "call_module")
        return node if ran_an_op else None
    return None


def describe_node(node: torch.fx.Node) -> str:
    """``node <name> (<op>), <source line>``."""
    target = node.target
    op = f"Tensor.{target}" if node.op == "call_method" else getattr(target, "__name__", str(target))
    return f"node {node.name} ({op}), {source_line(node)}"

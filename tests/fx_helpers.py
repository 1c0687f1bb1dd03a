"""Shared helpers of the FX pass tests: capture a Dynamo graph, build a pass context, run the passes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ppcompile.analysis.node_facts import STATIC_BUFFER
from ppcompile.config import PPBreakableConfig
from ppcompile.passes.context import PassContext
from ppcompile.passes.manager import PASSES
from ppcompile.records import StaticBuffer

__all__ = ["bridges", "dynamo_graph", "make_ctx", "op_targets", "run_until", "scaler"]


def dynamo_graph(
    fn_or_module: Callable[..., Any], *args: Any, dynamic: bool = True
) -> tuple[torch.fx.GraphModule, list[Any]]:
    """The Dynamo-level FX graph of ``fn_or_module(*args)`` and its example inputs, as a backend sees them.

    Dynamo drops ``meta["grapharg"]`` (the input sources) from placeholders once the backend returns; the
    passes read it inside the backend, so it is kept here and put back.
    """
    torch._dynamo.reset()
    captured: list[tuple[torch.fx.GraphModule, list[Any], dict[str, Any]]] = []

    def capture_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graphargs = {n.name: n.meta["grapharg"] for n in gm.graph.find_nodes(op="placeholder")
                     if "grapharg" in n.meta}
        captured.append((gm, list(example_inputs), graphargs))
        return gm.forward

    compiled = torch.compile(fn_or_module, backend=capture_backend, dynamic=dynamic, fullgraph=True)
    with torch.no_grad():
        compiled(*args)
    assert len(captured) == 1, f"expected one Dynamo graph, got {len(captured)}"
    gm, example_inputs, graphargs = captured[0]
    for node in gm.graph.find_nodes(op="placeholder"):
        if node.name in graphargs:
            node.meta["grapharg"] = graphargs[node.name]
    return gm, example_inputs


def make_ctx(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **options: Any) -> PassContext:
    """A fresh pass context for ``gm`` with ``options`` validated as the backend does. Tiny graph segments
    are not folded unless asked (``fold_graph_ops``): these tests look at one pass's own decisions."""
    options = {"fold_graph_ops": 0, **options}
    return PassContext(config=PPBreakableConfig.from_options(options), example_inputs=list(example_inputs))


def run_until(
    gm: torch.fx.GraphModule, ctx: PassContext, last: Callable[..., Any]
) -> torch.fx.GraphModule:
    """Runs the manager's passes in order up to and including ``last``; returns the resulting graph."""
    names = [p.__name__ for p in PASSES]
    assert last.__name__ in names, f"{last.__name__} is not in PASSES {names}"
    for p in PASSES:
        gm = p(gm, ctx).graph_module
        if p.__name__ == last.__name__:
            break
    return gm


def op_targets(gm: torch.fx.GraphModule) -> list[Any]:
    """The targets of the ``call_function`` / ``call_method`` nodes of ``gm``, in order."""
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def bridges(split: torch.fx.GraphModule) -> dict[str, StaticBuffer]:
    """Node name -> static buffer of each bridge ``lift_static_inputs`` planned (a break output that a
    graph segment reads), as lowering finds them: on the non-placeholder nodes of the split graph."""
    return {n.name: buffer for n in split.graph.nodes
            if n.op != "placeholder" and (buffer := STATIC_BUFFER.get(n)) is not None}


def scaler(factor: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """A closure multiplying by ``factor``: every one has the same module and qualname, not the same
    behaviour (keys that name functions must tell them apart)."""
    def scaled(t: torch.Tensor) -> torch.Tensor:
        return t * factor

    return scaled

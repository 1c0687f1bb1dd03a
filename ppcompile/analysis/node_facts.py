"""The facts the passes record on FX nodes, each under one ``node.meta`` key, read and written only here.

A pass that learns something about a node (its token dims, why it must break, which segment it calls)
records it in ``node.meta``; later passes, the backend and lowering read it back. Each fact is one
:class:`NodeFact` below, typed by its value (``TOKEN_DIMS.get(node)`` is a ``TokenDims``,
``SEGMENT.of(node)`` a ``Segment``), so a key is spelled once and a reader gets the type the writer put
there. A node without a fact gets None from ``get`` and a ``KeyError`` naming the writer from ``of``.

======================  ====================================  =====================  ======================
meta key (accessor)     what it says                          written by             read by
======================  ====================================  =====================  ======================
``pp_bound_weight``     a stamped layer's weight (a graph      expand_stamped_layers  find_token_dims
(``BOUND_WEIGHT``)      input the runtime binds), by its
                        name in the stage
``pp_token_dims``       a tensor's token dims and their       find_token_dims        check_padding_safety,
(``TOKEN_DIMS``)        sizes, ``((dim, size_expr), ...)``;                          token_locality,
                        ``()`` on a tensor without one (a                            prefix_causal,
                        parameter); absent on a static graph                         split_at_breaks (onto
                                                                                     segment outputs),
                                                                                     lowering.program
``pp_size_expr``        a number's value (a ``SymInt``, a     find_token_dims        find_token_dims,
(``SIZE_EXPR``)         one-element ``torch.Size``) in terms                         split_at_breaks (onto
                        of the symbols                                               segment outputs),
                                                                                     lowering.program
``pp_layer_id``         an attention call's global layer id   align_global_layers    split_at_breaks
(``LAYER_ID``)
``pp_token_local``      the declared token-local region the   find_declared_regions  check_padding_safety,
(``TOKEN_LOCAL``)       node lies in, ``"path (class)"``                             partitions,
                                                                                     split_at_breaks
``pp_eager_region``     the declared eager function the node  find_declared_regions  partitions,
(``EAGER_REGION``)      was traced inside                                            split_at_breaks
``pp_collective``       the collective a node calls, or the   find_collectives       check_padding_safety,
(``COLLECTIVE``)        round trip of one it belongs to                              check_capture_safety
                        (``records.Collective``)
``pp_unsafe``           why the node may not run on padded    check_padding_safety   check_padding_safety,
(``PADDING_UNSAFE``)    rows                                                         split_at_breaks
``pp_capture_unsafe``   why CUDA graph capture rejects the    check_capture_safety   split_at_breaks
(``CAPTURE_UNSAFE``)    node
``pp_break_cause``      why the node itself breaks (a node    split_at_breaks        lowering.whole_stage
(``BREAK_CAUSE``)       folded into a break has none)
``pp_segment``          the segment a ``call_module`` node    split_at_breaks        lift_static_inputs,
(``SEGMENT``)           of the split graph runs                                      segment_compilers,
                                                                                     lowering.program
``pp_static_buffer``    the static buffer of a graph-read     lift_static_inputs     lowering.program
(``STATIC_BUFFER``)     live input (a placeholder) or of a
                        break output (a bridge)
``pp_written_args``     positions of a ``call_module``        lift_static_inputs     lowering.program
(``WRITTEN_ARGS``)      node's arguments its segment writes
                        in place (``analysis/mutation.py``)
======================  ====================================  =====================  ======================

Not a node fact: ``pp_proxy_tensors`` is the stage's keyword argument, and the ``pp_token_local`` key
inside ``meta["custom"]`` is the annotation ``ppcompile.token_local`` adds while Dynamo traces
(``regions.ANNOTATION_KEY``), which ``find_declared_regions`` turns into ``TOKEN_LOCAL``.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import sympy
import torch

from ppcompile.records import BreakReason, Collective, Segment, StaticBuffer

__all__ = [
    "BOUND_WEIGHT",
    "BREAK_CAUSE",
    "CAPTURE_UNSAFE",
    "COLLECTIVE",
    "EAGER_REGION",
    "FACTS",
    "LAYER_ID",
    "PADDING_UNSAFE",
    "SEGMENT",
    "SIZE_EXPR",
    "STATIC_BUFFER",
    "TOKEN_DIMS",
    "TOKEN_LOCAL",
    "WRITTEN_ARGS",
    "NodeFact",
    "TokenDims",
    "segments",
    "token_dim_sizes",
    "token_dims",
]

T = TypeVar("T")

TokenDims = tuple[tuple[int, sympy.Expr], ...]  # ((dim, size expression), ...)


class NodeFact(Generic[T]):
    """One fact recorded on FX nodes as ``node.meta[key]``, set by the pass ``writer``."""

    __slots__ = ("key", "writer")

    def __init__(self, key: str, writer: str) -> None:
        self.key = key
        self.writer = writer

    def __repr__(self) -> str:
        return f"NodeFact({self.key!r}, writer={self.writer!r})"

    def get(self, node: torch.fx.Node) -> T | None:
        """The fact, or None when ``node`` has none."""
        value: T | None = node.meta.get(self.key)
        return value

    def of(self, node: torch.fx.Node) -> T:
        """The fact of a node that must have it; a ``KeyError`` naming the pass that sets it otherwise."""
        try:
            value: T = node.meta[self.key]
        except KeyError:
            raise KeyError(f"node {node.name} has no meta[{self.key!r}]; {self.writer} sets it, so it has "
                           f"not run on this graph or skipped this node") from None
        return value

    def has(self, node: torch.fx.Node) -> bool:
        return self.key in node.meta

    def set(self, node: torch.fx.Node, value: T) -> None:
        node.meta[self.key] = value


BOUND_WEIGHT: NodeFact[str] = NodeFact("pp_bound_weight", "expand_stamped_layers")
TOKEN_DIMS: NodeFact[TokenDims] = NodeFact("pp_token_dims", "find_token_dims")
SIZE_EXPR: NodeFact[sympy.Expr] = NodeFact("pp_size_expr", "find_token_dims")
LAYER_ID: NodeFact[int] = NodeFact("pp_layer_id", "align_global_layers")
TOKEN_LOCAL: NodeFact[str] = NodeFact("pp_token_local", "find_declared_regions")
EAGER_REGION: NodeFact[str] = NodeFact("pp_eager_region", "find_declared_regions")
COLLECTIVE: NodeFact[Collective] = NodeFact("pp_collective", "find_collectives")
PADDING_UNSAFE: NodeFact[str] = NodeFact("pp_unsafe", "check_padding_safety")
CAPTURE_UNSAFE: NodeFact[str] = NodeFact("pp_capture_unsafe", "check_capture_safety")
BREAK_CAUSE: NodeFact[BreakReason] = NodeFact("pp_break_cause", "split_at_breaks")
SEGMENT: NodeFact[Segment] = NodeFact("pp_segment", "split_at_breaks")
STATIC_BUFFER: NodeFact[StaticBuffer] = NodeFact("pp_static_buffer", "lift_static_inputs")
WRITTEN_ARGS: NodeFact[tuple[int, ...]] = NodeFact("pp_written_args", "lift_static_inputs")

# Every fact, in the order the passes first write them.
FACTS: tuple[NodeFact[Any], ...] = (
    BOUND_WEIGHT,
    TOKEN_DIMS, SIZE_EXPR, LAYER_ID, TOKEN_LOCAL, EAGER_REGION, COLLECTIVE, PADDING_UNSAFE,
    CAPTURE_UNSAFE, BREAK_CAUSE, SEGMENT, STATIC_BUFFER, WRITTEN_ARGS,
)


def segments(split: torch.fx.GraphModule) -> tuple[Segment, ...]:
    """The segments of a split graph in execution order: the ``SEGMENT`` of each ``call_module`` node."""
    return tuple(SEGMENT.of(node) for node in split.graph.find_nodes(op="call_module"))


def token_dims(value: Any) -> TokenDims:
    """The token dims of a node, ``()`` for a node without any and for an argument that is no node."""
    if not isinstance(value, torch.fx.Node):
        return ()
    return TOKEN_DIMS.get(value) or ()


def token_dim_sizes(value: Any) -> dict[int, sympy.Expr]:
    """``{dim: size expression}`` of the token dims of a node (empty as for :func:`token_dims`)."""
    return dict(token_dims(value))

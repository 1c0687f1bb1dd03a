"""Collectives in a stage graph: which keep token rows independent, and which group they run on.

Dynamo traces ``torch.distributed.all_reduce`` and ``torch.distributed._functional_collectives`` to
``_c10d_functional`` ops: the collective itself, then ``wait_tensor`` on its result. Across the ranks of
a group, an all-reduce or a broadcast combines row i of every rank's input into row i of the output:
token-local, like an elementwise op. The ops that move dim 0 (``all_gather_into_tensor`` stacks the
ranks' tensors along it, ``reduce_scatter_tensor`` splits it, ``all_to_all_single`` exchanges blocks of
it) are token-local when dim 0 is no token dim. A gather or reduce-scatter along another dim ``d``
reaches them through dim 0 and back, and is token-local as a whole: the functional API stacks along
dim 0, then chunks the result by rank and concatenates the chunks along ``d`` (or, for a reduce-scatter,
chunks along ``d`` and stacks along dim 0 first), so each rank's token rows end up in their own rows.
:func:`find_collective_uses` recognises that round trip and judges it as one op. Along the token dim
itself (sequence parallelism) a collective moves token rows between ranks: with padding, a rank's
padded rows would land among live rows (another rank's, or its own shifted), so it is a break that runs
on live rows.

Engine-style collective custom ops (``collective_ops``) are declared, not analysed: each is an
all-reduce-like op, row i of its outputs combines row i of its input across the group.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch

from ppcompile.analysis.node_facts import token_dim_sizes
from ppcompile.analysis.op_matching import op_name
from ppcompile.records import Collective
from ppcompile.torch_internals import OpOverload, qualified_op_name

__all__ = ["ELEMENTWISE", "MOVES_DIM0", "find_collective_uses", "functional_collective"]

#: ``_c10d_functional`` ops that combine or copy row i of every rank's input into row i of the output.
ELEMENTWISE = frozenset({"all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_",
                         "broadcast", "broadcast_", "wait_tensor"})
#: ``_c10d_functional`` ops that move data along dim 0 between ranks.
MOVES_DIM0 = frozenset({"all_gather_into_tensor", "all_gather_into_tensor_out",
                        "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
                        "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced",
                        "all_to_all_single"})
_NAMESPACE = "_c10d_functional::"
_ACROSS_TOKENS = {
    "all_gather": "stacks every rank's rows along dim 0, a token dim (sequence parallelism, or a gather "
                  "to another dim not written as chunk + cat, which ppcompile follows): a bucket's "
                  "padded rows would sit between the ranks' live rows",
    "reduce_scatter": "splits the token dim between ranks (sequence parallelism): with padding, each "
                      "rank would get other rows than its live share",
    "all_to_all": "exchanges token rows between ranks: with padding, padded rows would reach live rows "
                  "of other ranks",
}


def functional_collective(node: torch.fx.Node) -> str | None:
    """The name of the ``_c10d_functional`` op ``node`` calls (``all_reduce``), or None."""
    target = node.target
    qualname = qualified_op_name(target) if node.op == "call_function" else None
    return qualname[len(_NAMESPACE):] if qualname is not None and qualname.startswith(_NAMESPACE) else None


def _group_name(node: torch.fx.Node) -> str | None:
    """The ``group_name`` argument of a functional collective (wait_tensor has none)."""
    if "group_name" in node.kwargs:
        return str(node.kwargs["group_name"])
    target = node.target
    schema = (target if isinstance(target, OpOverload) else target.default)._schema  # type: ignore[union-attr]
    names = [a.name for a in schema.arguments]
    if "group_name" in names and names.index("group_name") < len(node.args):
        return str(node.args[names.index("group_name")])
    return None


def _ndim(node: torch.fx.Node) -> int:
    value = node.meta.get("example_value", node.meta.get("val"))
    return value.dim() if isinstance(value, torch.Tensor) else 0


def _dim_arg(node: torch.fx.Node, index: int) -> int | None:
    """A chunk's or a cat's ``dim`` argument, non-negative; None when it is no int."""
    dim = node.kwargs.get("dim", node.args[index] if len(node.args) > index else 0)
    source = node.args[0]
    first = source[0] if isinstance(source, (list, tuple)) and source else source
    ndim = _ndim(first) if isinstance(first, torch.fx.Node) else 0
    return dim % max(ndim, 1) if isinstance(dim, int) else None


def _is_call(node: object, name: str) -> bool:
    return isinstance(node, torch.fx.Node) and node.op in ("call_function", "call_method") and (
        op_name(node) == name)


def _chunk_pieces(chunk: torch.fx.Node, ranks: int) -> list[torch.fx.Node] | None:
    """The ``getitem`` users of a ``chunk(x, ranks, dim)`` node, one per index in order, or None when
    it has other users or misses one."""
    items = {u.args[1]: u for u in chunk.users if u.target is operator.getitem}
    if len(items) != len(chunk.users) or set(items) != set(range(ranks)):
        return None
    return [items[i] for i in range(ranks)]


def _cat_of(pieces: list[torch.fx.Node]) -> torch.fx.Node | None:
    """The one ``cat`` that takes exactly ``pieces``, in order, and is each piece's only user."""
    users = {u for p in pieces for u in p.users}
    if len(users) != 1 or any(len(p.users) != 1 for p in pieces):
        return None
    cat = next(iter(users))
    parts = cat.args[0]
    if not _is_call(cat, "cat") or not isinstance(parts, (list, tuple)) or list(parts) != pieces:
        return None
    return cat


def _gather_round_trip(gather: torch.fx.Node, ranks: int) -> tuple[list[torch.fx.Node], int] | None:
    """``all_gather_into_tensor -> wait_tensor -> chunk(ranks, 0) -> cat(d)``: its nodes after the
    gather and ``d``, when ``d`` is no token dim; else None."""
    waits: list[torch.fx.Node] = []
    last = gather
    while len(last.users) == 1 and functional_collective(next(iter(last.users))) == "wait_tensor":
        last = next(iter(last.users))  # funcol waits once itself; a caller may wait again
        waits.append(last)
    if not waits or len(last.users) != 1:
        return None
    chunk = next(iter(last.users))
    if not _is_call(chunk, "chunk") or chunk.args[1] != ranks or _dim_arg(chunk, 2) != 0:
        return None
    pieces = _chunk_pieces(chunk, ranks)
    cat = _cat_of(pieces) if pieces else None
    if cat is None or pieces is None:
        return None
    dim = _dim_arg(cat, 1)
    if dim is None or dim in token_dim_sizes(pieces[0]):
        return None
    return [*waits, chunk, *pieces, cat], dim


def _scatter_round_trip(scatter: torch.fx.Node, ranks: int) -> tuple[list[torch.fx.Node], int] | None:
    """``chunk(x, ranks, d) -> cat(0) -> reduce_scatter_tensor``: its nodes before the scatter and
    ``d``, when ``d`` is no token dim of ``x``; else None."""
    cat = scatter.args[0]
    if not isinstance(cat, torch.fx.Node) or not _is_call(cat, "cat") or _dim_arg(cat, 1) != 0:
        return None
    pieces = cat.args[0]
    if len(cat.users) != 1 or not isinstance(pieces, (list, tuple)) or not pieces:
        return None
    chunk = pieces[0].args[0] if isinstance(pieces[0], torch.fx.Node) else None
    if not isinstance(chunk, torch.fx.Node) or not _is_call(chunk, "chunk") or chunk.args[1] != ranks:
        return None
    items = _chunk_pieces(chunk, ranks)
    if items is None or items != list(pieces):
        return None
    dim = _dim_arg(chunk, 2)
    if dim is None or dim in token_dim_sizes(chunk.args[0]):
        return None
    return [chunk, *items, cat], dim


# The ops whose round trip through dim 0 to another dim is recognised: its label and its finder.
_RoundTrip = Callable[[torch.fx.Node, int], "tuple[list[torch.fx.Node], int] | None"]
_ROUND_TRIPS: dict[str, tuple[str, _RoundTrip]] = {
    "all_gather_into_tensor": ("all_gather", _gather_round_trip),
    "reduce_scatter_tensor": ("reduce_scatter", _scatter_round_trip),
}


def _ranks_arg(node: torch.fx.Node) -> int | None:
    size = node.kwargs.get("group_size", next((a for a in node.args[1:] if isinstance(a, int)), None))
    return size if isinstance(size, int) else None


def find_collective_uses(
    graph: torch.fx.Graph, declared: Callable[[torch.fx.Node], bool]
) -> dict[torch.fx.Node, Collective]:
    """Every collective node of ``graph`` (functional ones, and those ``declared`` says are declared
    collective ops) with its verdict, plus the chunk/cat nodes of a gather or reduce-scatter along a
    non-token dim, which share the collective's verdict (token-local as a whole)."""
    uses: dict[torch.fx.Node, Collective] = {}
    for node in graph.nodes:
        if node in uses:
            continue
        name = functional_collective(node)
        if name is None:
            if declared(node):
                uses[node] = Collective(op_name(node, qualified=True), None)
            continue
        group = _group_name(node)
        if name == "wait_tensor":
            source = node.args[0]
            waited = uses.get(source) if isinstance(source, torch.fx.Node) else None
            unsafe = None if waited is None or waited.unsafe is None else f"waits for {waited.op}, a break"
            uses[node] = Collective(name, waited.group if waited else None, unsafe)
            continue
        if name in ELEMENTWISE or name not in MOVES_DIM0:
            unknown = None if name in ELEMENTWISE else f"is a collective ppcompile has no rule for ({name})"
            uses[node] = Collective(name, group, unknown)
            continue
        source = node.args[0]
        tensors = source if isinstance(source, (list, tuple)) else [source]
        if not any(isinstance(t, torch.fx.Node) and 0 in token_dim_sizes(t) for t in tensors):
            uses[node] = Collective(f"{name} along dim 0", group)  # every tensor's dim 0 is no token dim
            continue
        kind = next(k for k in _ACROSS_TOKENS if name.startswith(k))
        ranks = _ranks_arg(node)
        label, round_trip = _ROUND_TRIPS.get(name, ("", None))
        found = round_trip(node, ranks) if round_trip is not None and ranks is not None else None
        if found is not None:
            use = Collective(f"{label} along dim {found[1]}", group)
            uses.update({n: use for n in (node, *found[0])})
            continue
        uses[node] = Collective(f"{name} along the token dim", group, _ACROSS_TOKENS.get(kind))
    return uses

"""Prefix-causal ops: row ``i`` of the output depends only on rows ``<= i`` along a token dim.

Padding sits after the live rows, so such an op cannot change a live row: a scan along tokens
(``cumsum``, ``cummax``, ...), a causal ``conv1d`` (padding ``p >= dilation * (kernel - 1)``, stride 1)
and a prefix slice (``x[:k]``, ``narrow(d, 0, k)``) all keep rows ``[0, n)`` what eager mode computes.
``check_padding_safety`` graphs them.

One catch: a causal conv1d's output is longer than its input (``n + p`` rows for ``p`` front and
back padding), and its last rows read what follows the input's live rows. Eagerly that is the conv's
zero padding; in a graph it is the bucket's padded rows. Those rows are a *dirty tail*: the value is
correct on rows ``[0, clean)`` only. :func:`escaping_tails` follows every dirty tail through
token-local ops and accepts it only when a prefix slice cuts it off before anything else reads it (as
``conv1d(x)[..., :n]`` does); otherwise the op that made it must run eagerly.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping
from typing import Any

import sympy
import torch

from ppcompile.analysis.node_facts import token_dim_sizes
from ppcompile.analysis.op_matching import op_name
from ppcompile.symbolic import example_value, first_exceeding
from ppcompile.torch_internals import qualified_op_name

__all__ = ["CONV_OPS", "SCAN_OPS", "Tail", "causal_conv_tail", "escaping_tails", "is_prefix_slice"]

SCAN_OPS = frozenset(("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"))
CONV_OPS = frozenset(("conv1d",))  # by plain name: the function, the method and every aten overload


def _int(value: Any) -> int | None:
    """A traced int argument (or a one-element tuple of one), else None."""
    if isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _argument(node: torch.fx.Node, i: int, key: str, default: Any) -> Any:
    return node.kwargs.get(key, node.args[i] if len(node.args) > i else default)


@dataclasses.dataclass(frozen=True)
class Tail:
    """A value whose token dim of size ``extent`` is correct on rows ``[0, clean)`` only; ``origins`` are
    the ops that made the tail. The dim is found by its size, which views and transposes keep."""

    extent: sympy.Expr
    clean: sympy.Expr
    origins: frozenset[torch.fx.Node]


def causal_conv_tail(node: torch.fx.Node) -> Tail | str | None:
    """For a ``conv1d`` along a token dim: its dirty tail (None if it has none), or why it is not causal.

    ``conv1d(x, w, b, stride, padding, dilation, groups)`` on ``x [N, C, T]``: output row ``j`` reads
    input rows ``j - p .. j - p + d * (k - 1)``; causal when ``d * (k - 1) <= p``.
    """
    def arg(i: int, key: str, default: Any) -> Any:
        return _argument(node, i, key, default)

    x = arg(0, "input", None)
    token = token_dim_sizes(x)
    ndim = example_value(x).dim() if isinstance(x, torch.fx.Node) else 0
    if not token or set(token) != {ndim - 1}:
        return None if not token or ndim - 1 not in token else "convolves over more than the token dim"
    w = arg(1, "weight", None)
    weight = example_value(w) if isinstance(w, torch.fx.Node) else None
    kernel = int(weight.shape[-1]) if isinstance(weight, torch.Tensor) else None
    stride, padding = _int(arg(3, "stride", 1)), _int(arg(4, "padding", 0))
    dilation = _int(arg(5, "dilation", 1))
    if None in (kernel, stride, padding, dilation) or stride != 1:
        return "convolves along the token dim with a stride, or a padding or kernel it cannot read"
    assert kernel is not None and padding is not None and dilation is not None
    if dilation * (kernel - 1) > padding:
        return "convolves along the token dim reading rows ahead of each output row"
    out = token_dim_sizes(node).get(ndim - 1)
    clean = token[ndim - 1]
    if out is None or sympy.simplify(out - clean) == 0:
        return None
    return Tail(out, clean, frozenset((node,)))


def _slice_kind(node: torch.fx.Node) -> str | None:
    """``"narrow"`` for ``narrow`` (a method, a function, ``aten.narrow``), ``"slice"`` for
    ``aten.slice`` (``x[..., :k]`` in an exported graph), else None."""
    if (qualname := qualified_op_name(node.target)) is not None:
        return _ATEN_SLICES.get(qualname)
    return "narrow" if node.op in ("call_method", "call_function") and op_name(node) == "narrow" else None


_ATEN_SLICES = {"aten::narrow": "narrow", "aten::narrow_copy": "narrow", "aten::slice": "slice",
                "aten::slice_copy": "slice"}


def is_prefix_slice(node: torch.fx.Node) -> bool:
    """``x[..., :k]`` / ``x.narrow(d, 0, k)`` / ``aten.slice(x, d, 0, k)`` taking a prefix of each token
    dim it touches (start 0, step 1) and nothing else along token dims."""
    src = node.args[0] if node.args else None
    token = token_dim_sizes(src)
    if not token or not isinstance(src, torch.fx.Node):
        return False
    kind = _slice_kind(node)
    if kind is not None:  # narrow(x, dim, start, length), slice(x, dim=0, start=None, end=None, step=1)
        dim, start = _argument(node, 1, "dim", 0), _argument(node, 2, "start", None)
        step = _argument(node, 4, "step", 1) if kind == "slice" else 1
        rank = example_value(src).dim()
        return (isinstance(dim, int) and dim % rank in token and (start is None or _int(start) == 0)
                and _int(step) == 1)
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) < 2:
        return False
    index: Any = node.args[1]
    items: list[Any] = list(index) if isinstance(index, tuple) else [index]
    if not all(isinstance(i, slice) for i in items):
        return False  # keep to plain slices: positions are then dims
    touched = False
    for dim, item in enumerate(items):
        if dim in token and item != slice(None):
            if item.start not in (None, 0) or item.step not in (None, 1):
                return False
            touched = True
    return touched


def _dims_of(node: torch.fx.Node, extent: sympy.Expr) -> list[int]:
    return [d for d, e in token_dim_sizes(node).items() if e == extent]


def _cuts_off(node: torch.fx.Node, tail: Tail, token: sympy.Symbol, cap: int) -> bool:
    """Whether ``node`` is a prefix slice of the tail's dim no longer than its clean rows (a prefix slice
    keeps dim positions, so the sliced dim is where the tail's dim was)."""
    src = node.args[0]
    if not is_prefix_slice(node) or not isinstance(src, torch.fx.Node):
        return False
    out = token_dim_sizes(node)
    dims = _dims_of(src, tail.extent)
    return len(dims) == 1 and dims[0] in out and first_exceeding(out[dims[0]], tail.clean, token, cap) is None


def escaping_tails(
    gm: torch.fx.GraphModule,
    tails: Mapping[torch.fx.Node, Tail],
    stays_graphed: Callable[[torch.fx.Node], bool],
    token: sympy.Symbol,
    cap: int,
) -> dict[torch.fx.Node, str]:
    """Ops whose dirty tail reaches something other than a prefix slice that cuts it off, each with what
    it reaches. A tail flows through ops ``stays_graphed`` accepts that keep its dim whole (elementwise
    ops, views and transposes that move the dim); a prefix slice no longer than ``clean`` ends it."""
    state: dict[torch.fx.Node, Tail] = dict(tails)
    escapes: dict[torch.fx.Node, str] = {}
    for node in gm.graph.nodes:
        dirty = list(dict.fromkeys(state[a] for a in node.all_input_nodes if a in state))
        if not dirty:
            continue
        if node.op != "output" and node not in tails and len(dirty) == 1:
            (tail,) = dirty
            if _cuts_off(node, tail, token, cap):
                continue
            if stays_graphed(node) and len(_dims_of(node, tail.extent)) == 1:
                state[node] = tail
                continue
        what = "the stage's outputs" if node.op == "output" else op_name(node)
        for tail in dirty:
            escapes.update({o: what for o in tail.origins if o not in escapes})
    return escapes

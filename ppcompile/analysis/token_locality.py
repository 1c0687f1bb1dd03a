"""Which ops keep token rows independent: the rules ``check_padding_safety`` applies, op by op.

A graph replays ``b >= n`` rows; padded rows ``[n:b]`` must not reach live rows. An op is *token-local*
when every token index of its output depends only on the same token index of its inputs. The rules
below decide that from the op's semantics and the traced token dims of its arguments
(``meta["pp_token_dims"]``, set by ``find_token_dims``). A rule returns ``None`` when the node is
token-local, else the reason it is not. Ops without a rule are unsafe unless registered with
``register_token_local_op`` (or the ``token_local_ops`` option).

Rules are keyed by name: a torch function's, a ``Tensor`` method's, an aten op's (``aten::slice`` is
``slice``). A rule reads an aten op's arguments by the op's own schema (:func:`_arg`), not in the order
of the torch function of the same name: ``aten.embedding(weight, indices)`` against
``F.embedding(input, weight)``, ``aten.var.default(self, unbiased)``, which has no ``dim``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ppcompile.analysis.node_facts import token_dim_sizes
from ppcompile.analysis.op_matching import resolve_op
from ppcompile.analysis.prefix_causal import CONV_OPS, SCAN_OPS, causal_conv_tail, is_prefix_slice
from ppcompile.engine_ops import refuse_token_local
from ppcompile.torch_internals import OpOverload, OpOverloadPacket, qualified_op_name

__all__ = [
    "RULES",
    "is_registered_token_local",
    "register_token_local_op",
    "rule_for",
]

Rule = Callable[[torch.fx.Node], "str | None"]

_REGISTERED: set[Any] = set()


def register_token_local_op(op: Any) -> None:
    """Declares ``op`` (an op, packet, or ``"ns::name"``) token-local: row i of its outputs depends only
    on row i of its inputs, so it may run inside graphs on padded buckets. A known engine op that writes
    state through a context (``engine_ops``) raises ``ValueError``."""
    resolved = resolve_op(op)
    refuse_token_local(resolved)
    _REGISTERED.add(resolved)


def is_registered_token_local(target: Any, extra: Sequence[Any] = ()) -> bool:
    packet = target.overloadpacket if isinstance(target, OpOverload) else None
    pool = _REGISTERED.union(extra)
    return target in pool or (packet is not None and packet in pool)


# ------------------------------------------------------------------------------------------ helpers
def _value(arg: Any) -> Any:
    return arg.meta.get("example_value", arg.meta.get("val")) if isinstance(arg, torch.fx.Node) else None


def _ndim(arg: Any) -> int:
    value = _value(arg)
    return value.dim() if isinstance(value, torch.Tensor) else 0


def _is_tensor(arg: Any) -> bool:
    return isinstance(_value(arg), torch.Tensor)


def _positions(target: Any, name: str) -> set[int] | None:
    """Where an aten op's schema takes ``name`` positionally (None: not an op). A packet's overloads on
    tensors may each take it: ``aten.slice`` is ``slice.Tensor`` here, not ``slice.str``."""
    if isinstance(target, OpOverload):
        schemas = [target._schema]
    elif isinstance(target, OpOverloadPacket):
        schemas = [s for s in (getattr(target, o)._schema for o in target.overloads())
                   if s.arguments and str(s.arguments[0].type) == "Tensor"]
    else:
        return None
    return {i for s in schemas for i, a in enumerate(s.arguments) if a.name == name and not a.kwarg_only}


def _arg(node: torch.fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` of ``node``: a keyword, else positional ``index`` (the torch function's), but
    for an op the position its schema gives ``name``; ``default`` where the op has no such argument
    (``aten.var.default(self, unbiased)`` has no ``dim``) or the call leaves it out."""
    if name in node.kwargs:
        return node.kwargs[name]
    positions = _positions(node.target, name)
    if positions is not None and len(positions) != 1:
        return default if not positions else _arg_at(node, index, default)  # several: torch's order
    return _arg_at(node, positions.pop() if positions else index, default)


def _arg_at(node: torch.fx.Node, index: int, default: Any) -> Any:
    return node.args[index] if len(node.args) > index else default


def _norm_dims(dim: Any, ndim: int) -> list[int] | None:
    if dim is None or isinstance(dim, bool):
        return None  # a bool where a dim may stand is ``unbiased`` (``x.var(True)``): every dim
    dims = list(dim) if isinstance(dim, (list, tuple)) else [dim]
    if not all(isinstance(d, int) for d in dims):
        return []  # a dynamic dim index: treated as unknown below
    return [d % max(ndim, 1) for d in dims]


def _touching(dims: list[int] | None, src: Any, what: str) -> str | None:
    token = token_dim_sizes(src)
    if not token:
        return None
    if dims is None:
        return f"{what} over every dim, including the token dim"
    if dims == [] or any(d in token for d in dims):
        return f"{what} along the token dim"
    return None


# ------------------------------------------------------------------------------------------ rules
def pointwise(node: torch.fx.Node) -> str | None:
    """Elementwise with broadcasting: each input token dim must land on the same output token dim."""
    out, rank = token_dim_sizes(node), _ndim(node)
    for arg in node.all_input_nodes:  # only nodes have token dims
        for d, expr in token_dim_sizes(arg).items():
            o = d + rank - _ndim(arg)
            if out.get(o) != expr:
                return "broadcasts a token dim onto another dim"
    return None


def _reduce(default: Any, index: int = 1, what: str = "reduces") -> Rule:
    def rule(node: torch.fx.Node) -> str | None:
        src = node.args[0]
        if what == "reduces" and _is_tensor(_arg(node, index, "other")):
            return pointwise(node)  # max(a, b) / min(a, b): elementwise
        dim = _arg(node, index, "dim", default)
        return _touching(_norm_dims(dim, _ndim(src)), src, what)

    rule.__doc__ = f"Token-local unless it {what} over a token dim (no dim: over every dim)."
    return rule


def _dim_op(index: int, default: Any, what: str) -> Rule:
    def rule(node: torch.fx.Node) -> str | None:
        src = node.args[0]
        return _touching(_norm_dims(_arg(node, index, "dim", default), _ndim(src)), src, what)

    rule.__doc__ = f"Token-local unless it {what} along a token dim."
    return rule


def linear(node: torch.fx.Node) -> str | None:
    """``linear(x, w, b)`` contracts x's last dim; weights must not scale with tokens."""
    x = node.args[0]
    if _ndim(x) - 1 in token_dim_sizes(x):
        return "contracts over the token dim"
    if any(token_dim_sizes(a) for a in node.args[1:]):
        return "its weight scales with tokens"
    return None


def matmul(node: torch.fx.Node) -> str | None:
    """Matrix products: token-local unless a contracted dim is a token dim."""
    return _contracts(node.args[0], node.args[1])


def _contracts(a: Any, b: Any) -> str | None:
    if _ndim(a) - 1 in token_dim_sizes(a) or max(_ndim(b) - 2, 0) in token_dim_sizes(b):
        return "contracts over the token dim"
    return None


def addmm(node: torch.fx.Node) -> str | None:
    """``addmm(bias, a, b)``, ``baddbmm``: a matrix product plus an elementwise add.

    Token-local unless a contracted dim is a token dim (``aten.linear`` decomposed: ``addmm(b, x, t(w))``)."""
    return _contracts(node.args[1], node.args[2]) or pointwise(node)


def embedding(node: torch.fx.Node) -> str | None:
    """Table lookups by token-major indices: token-local unless the table scales with tokens."""
    table = _arg(node, 0 if node.target is torch.embedding else 1, "weight")  # F.embedding(input, weight)
    return "its table scales with tokens" if token_dim_sizes(table) else None


def index(node: torch.fx.Node) -> str | None:
    """``aten.index(x, indices)`` (``x[idx]``): token-local unless it indexes a token dim of ``x``.

    A bool mask indexes as many dims as it has."""
    src, indices = node.args[0], _arg(node, 1, "indices", ())
    token = token_dim_sizes(src)
    if not _is_tensor(src) or not token:
        return None
    if not isinstance(indices, (list, tuple)):
        return "gathers along the token dim"
    dim = 0
    for idx in indices:
        mask = _is_tensor(idx) and _value(idx).dtype in (torch.bool, torch.uint8)
        width = _ndim(idx) if mask else 1
        if idx is not None and any(d in token for d in range(dim, dim + width)):
            return "gathers along the token dim"
        dim += width
    return None


def permute(node: torch.fx.Node) -> str | None:
    """Dim permutations: always token-local (the token dim moves, rows stay whole)."""
    return None  # moves the token dim; rows stay whole


def reshape(node: torch.fx.Node) -> str | None:
    """A reshape keeps rows whole when the static dims before the token dim hold as many elements before
    as after, and each token keeps its elements together: the same token dim, or a token-major fold or
    unfold of it (``[T, k, d] <-> [T*k, d]``: ``c*T`` rows either way, the same elements per token)."""
    src = node.args[0]
    before, after = token_dim_sizes(src), token_dim_sizes(node)
    if not before and not after:
        return None
    if len(before) != 1 or len(after) != 1:
        return "reshapes across token dims"
    (di, ei), (do, eo) = next(iter(before.items())), next(iter(after.items()))
    shape_in = src.meta.get("example_value", src.meta.get("val")).shape  # type: ignore[union-attr]
    shape_out = node.meta.get("example_value", node.meta.get("val")).shape  # type: ignore[union-attr]
    prefix_in = [int(s) for s in shape_in[:di] if not isinstance(s, torch.SymInt)]
    prefix_out = [int(s) for s in shape_out[:do] if not isinstance(s, torch.SymInt)]
    if len(prefix_in) != di or len(prefix_out) != do or math.prod(prefix_in) != math.prod(prefix_out):
        return "moves data across token rows"
    if ei == eo:
        return None
    inner_in = [int(s) for s in shape_in[di + 1:] if not isinstance(s, torch.SymInt)]
    inner_out = [int(s) for s in shape_out[do + 1:] if not isinstance(s, torch.SymInt)]
    (ci, rest_in), (co, rest_out) = ei.as_coeff_Mul(), eo.as_coeff_Mul()
    if (rest_in == rest_out and len(inner_in) == len(shape_in) - di - 1
            and len(inner_out) == len(shape_out) - do - 1
            and ci * math.prod(inner_in) == co * math.prod(inner_out)):
        return None  # token-major: token t's elements stay one contiguous block
    return "folds the token dim into another dim"


def getitem(node: torch.fx.Node) -> str | None:
    """Indexing: slicing or selecting along the token dim, or gathering token rows, mixes rows; a prefix
    slice (``x[:k]``) is prefix-causal."""
    src, index = node.args[0], node.args[1]
    if not _is_tensor(src) or is_prefix_slice(node):
        return None  # picks an element of a tuple, or a prefix of the rows
    token = token_dim_sizes(src)
    if not token:
        return None
    items = list(index) if isinstance(index, tuple) else [index]
    if any(i is Ellipsis for i in items):
        pos = items.index(Ellipsis)
        consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
        items[pos : pos + 1] = [slice(None)] * (_ndim(src) - consumed)
    dim = 0
    for item in items:
        if item is None:
            continue
        if dim in token and item != slice(None):
            return "slices, selects or gathers along the token dim"
        dim += 1
    return None


def cat(node: torch.fx.Node) -> str | None:
    """Concatenation: token-local unless along a token dim."""
    tensors = node.args[0]
    first = tensors[0] if isinstance(tensors, (list, tuple)) and tensors else None
    dim = _norm_dims(_arg(node, 1, "dim", 0), _ndim(first))
    return _touching(dim, first, "concatenates") if first is not None else None


def layer_norm(node: torch.fx.Node) -> str | None:
    """Norms over trailing dims: token-local unless a normalized dim is a token dim."""
    src, shape = node.args[0], _arg(node, 1, "normalized_shape", ())
    count = len(shape) if isinstance(shape, (list, tuple)) else 1
    return _touching(list(range(_ndim(src) - count, _ndim(src))), src, "normalizes")


def narrow(node: torch.fx.Node) -> str | None:
    """``narrow``, ``aten.slice``: token-local along other dims; a token-dim prefix is prefix-causal.

    ``narrow(dim, start, length)``, ``aten.slice(dim, start, end, step)``: a prefix of a token dim (start
    0, step 1) reads rows ``<= i`` only; other starts or steps shift rows."""
    src = node.args[0] if node.args else None
    if not _is_tensor(src) or is_prefix_slice(node):
        return None
    return _touching(_norm_dims(_arg(node, 1, "dim", 0), _ndim(src)), src, "slices")


def scan(node: torch.fx.Node) -> str | None:
    """Scans (``cumsum``, ``cummax``, ...): along a token dim row ``i`` reads rows ``<= i`` only, which
    padding after the live rows cannot reach (prefix-causal); along other dims token-local."""
    return None


def conv1d(node: torch.fx.Node) -> str | None:
    """``conv1d`` along a token dim: causal (each output row reads rows at or before it) or not."""
    verdict = causal_conv_tail(node)
    return verdict if isinstance(verdict, str) else None


def item(node: torch.fx.Node) -> str | None:
    """``Tensor.item``: token-local only on tensors without token dims."""
    return "reads one element of a token-sized tensor" if token_dim_sizes(node.args[0]) else None


def factory(node: torch.fx.Node) -> str | None:
    """New tensors and metadata (factories, ``stack``, sizes, metadata asserts): always token-local."""
    return None  # new tensors: each row is filled independently


_POINTWISE = (
    "add", "sub", "mul", "truediv", "floordiv", "div", "pow", "neg", "abs", "exp", "exp2", "expm1",
    "log", "log1p", "log2", "rsqrt", "sqrt", "square", "sigmoid", "tanh", "relu", "relu6", "silu",
    "gelu", "softplus", "mish", "elu", "leaky_relu", "hardtanh", "hardswish", "hardsigmoid", "sin",
    "cos", "erf", "reciprocal", "sign", "floor", "ceil", "round", "trunc", "clamp", "clamp_min",
    "clamp_max", "clip", "maximum", "minimum", "where", "masked_fill", "lerp", "addcmul", "addcdiv",
    "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "logical_xor",
    "bitwise_and", "bitwise_or", "bitwise_not", "bitwise_xor", "and_", "or_", "xor", "invert", "mod",
    "remainder", "fmod", "float", "half", "bfloat16", "double", "int", "long", "bool", "to", "type",
    "type_as", "contiguous", "clone", "detach", "iadd", "isub", "imul", "itruediv", "add_", "sub_",
    "mul_", "div_", "copy_", "fill_", "zero_", "clamp_", "masked_fill_", "relu_", "silu_", "zeros_like",
    "ones_like", "empty_like", "full_like", "dropout", "nan_to_num", "expand", "expand_as",
    # aten ops of exported and AOT graphs
    "_to_copy", "copy", "alias", "lift_fresh_copy", "rsub", "true_divide", "floor_divide",
)

RULES: dict[str, Rule] = {name: pointwise for name in _POINTWISE}
RULES.update({
    name: _reduce(None) for name in
    (
        "sum", "mean", "amax", "amin", "max", "min", "prod", "var", "std", "logsumexp", "argmax",
        "argmin", "any", "all", "nansum", "nanmean", "var_mean", "std_mean",
    )
})
RULES.update({name: _reduce(None, index=2) for name in ("norm", "linalg_vector_norm")})  # (x, p, dim)
RULES.update({name: _reduce(None, what="normalizes") for name in (
    "softmax", "log_softmax", "_softmax", "_log_softmax")})
RULES.update({name: scan for name in SCAN_OPS})
RULES.update({name: conv1d for name in CONV_OPS})
RULES.update({"topk": _dim_op(2, -1, "ranks"), "sort": _dim_op(1, -1, "ranks"),
              "argsort": _dim_op(1, -1, "ranks"), "kthvalue": _dim_op(2, -1, "ranks")})
RULES.update({name: _dim_op(2, 0, "splits") for name in (
    "split", "chunk", "tensor_split", "split_with_sizes", "unsafe_split", "unsafe_split_with_sizes")})
RULES.update({"unbind": _dim_op(1, 0, "splits"), "select": _dim_op(1, None, "selects"), "index": index,
              "_unsafe_index": index})
RULES.update({name: narrow for name in ("narrow", "narrow_copy", "slice", "slice_copy")})
RULES.update({name: _dim_op(1, None, "gathers or scatters") for name in (
    "gather", "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "index_select",
    "index_add", "index_add_", "index_copy", "index_copy_", "index_fill", "index_fill_")})
RULES.update({name: reshape for name in (
    "view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "view_as", "reshape_as",
    "_unsafe_view")})
RULES.update({name: permute for name in ("transpose", "permute", "t", "movedim", "swapaxes", "swapdims")})
RULES.update({name: factory for name in (
    "zeros", "ones", "empty", "full", "arange", "tensor", "scalar_tensor", "size", "dim", "stride",
    "numel", "sym_size", "sym_numel", "sym_stride", "get_device", "new_empty", "new_zeros", "new_ones",
    "new_full", "empty_strided", "sym_storage_offset", "_assert_tensor_metadata")})
RULES["repeat_interleave"] = _dim_op(2, None, "repeats")  # repeat_interleave(x, repeats, dim)
RULES.update({"linear": linear, "matmul": matmul, "mm": matmul, "bmm": matmul, "embedding": embedding,
              "addmm": addmm, "baddbmm": addmm, "native_layer_norm": layer_norm,
              "_fused_rms_norm": layer_norm, "_local_scalar_dense": item,
              "getitem": getitem, "cat": cat, "concat": cat, "concatenate": cat, "stack": factory,
              "layer_norm": layer_norm, "rms_norm": layer_norm, "item": item})
# stack adds a new dim and keeps each input's token dims: token-local like a factory of its inputs.

_TORCH_MODULES = ("torch", "_operator", "operator", "builtins", "math")

def rule_for(node: torch.fx.Node) -> Rule | None:
    """The rule for a node's op: by method name, or by name for torch/operator functions."""
    if node.op == "call_method":
        return RULES.get(str(node.target))
    target = node.target
    if (qualname := qualified_op_name(target)) is not None:
        # custom ops: unknown unless registered
        return RULES.get(qualname[len("aten::"):]) if qualname.startswith("aten::") else None
    module = getattr(target, "__module__", None) or ""
    if target is operator.getitem or module.split(".")[0] in _TORCH_MODULES:
        return RULES.get(getattr(target, "__name__", ""))
    return None

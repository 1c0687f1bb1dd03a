"""``token_locality`` on aten ops, as graphs traced by ``torch.export`` and by pipelining's tracer
(``pipe_split`` + ``pipeline()``) hold them: each rule reads the op's own schema, not the argument order
of the torch function of the same name.

Each test traces a few aten calls with Dynamo (dim 0 of every argument a token dim, tables and weights
module constants) and runs the passes up to ``check_padding_safety``; it reads the verdict on each aten
node: None (token-local, stays in a graph) or the reason it breaks. Each op has a case that stays and,
where the op can mix rows, one that must break; an op with no row-mixing form is paired with a
``flip`` along the tokens, which no rule knows (the verdict an op without a rule would get).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from fx_helpers import dynamo_graph, make_ctx, run_until

import ppcompile
from ppcompile.analysis.node_facts import PADDING_UNSAFE
from ppcompile.passes.check_padding_safety import check_padding_safety
from ppcompile.torch_internals import OpOverload, OpOverloadPacket

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

aten = torch.ops.aten
T = 6  # tokens of the traced call
TABLE = torch.randn(11, 8)  # an embedding table: module state, no token dim
W = torch.randn(16, 8)  # a linear weight [out, in]
BIAS = torch.randn(16)
UNKNOWN = "not known to be token-local"


def _verdicts(fn: Callable[..., Any], *args: torch.Tensor) -> list[tuple[str, str | None]]:
    """(op, verdict) of each aten node of ``fn``'s graph, in order; verdict None: token-local."""
    ppcompile.mark_token_dynamic(*args)
    gm, example_inputs = dynamo_graph(fn, *args, dynamic=False)
    gm = run_until(gm, make_ctx(gm, example_inputs), check_padding_safety)
    return [(str(n.target), PADDING_UNSAFE.get(n)) for n in gm.graph.nodes
            if isinstance(n.target, (OpOverload, OpOverloadPacket))]


def _assert(got: list[tuple[str, str | None]], want: list[tuple[str, str | None]]) -> None:
    """``want``'s verdicts: None (token-local) or a part of the reason the node breaks."""
    assert [op for op, _ in got] == [op for op, _ in want], got
    for (op, reason), (_, part) in zip(got, want):
        if part is None:
            assert reason is None, f"{op} breaks: {reason}"
        else:
            assert reason is not None and part in reason, f"{op}: {reason!r}, expected {part!r}"


def _x() -> torch.Tensor:
    return torch.randn(T, 4, 8)  # [tokens, heads, head_dim]


def _h() -> torch.Tensor:
    return torch.randn(T, 8)  # [tokens, hidden]


def _ids() -> torch.Tensor:
    return torch.randint(11, (T,))


def test_embedding_reads_the_table_by_schema() -> None:
    """``aten.embedding(weight, indices)``: the table is argument 0 (``F.embedding(input, weight)``
    has it at 1); a table that scales with tokens breaks."""
    idx = torch.tensor([0, 2])
    got = _verdicts(lambda ids, h: (aten.embedding.default(TABLE, ids), aten.embedding(TABLE, ids),
                                    aten.embedding.default(h, idx)), _ids(), _h())
    _assert(got, [("aten.embedding.default", None), ("aten.embedding", None),
                  ("aten.embedding.default", "table scales with tokens")])


def test_torch_level_embeddings_keep_their_own_order() -> None:
    """``F.embedding(input, weight)`` and ``torch.embedding(weight, input)`` (no aten op: by target)."""
    idx = torch.tensor([0, 2])
    ppcompile.mark_token_dynamic(_ids())
    for fn in (lambda ids, h: F.embedding(ids, TABLE) + F.embedding(idx, h).sum(),
               lambda ids, h: torch.embedding(TABLE, ids) + torch.embedding(h, idx).sum()):
        ids, h = _ids(), _h()
        ppcompile.mark_token_dynamic(ids, h)
        gm, example_inputs = dynamo_graph(fn, ids, h, dynamic=False)
        gm = run_until(gm, make_ctx(gm, example_inputs), check_padding_safety)
        got = [PADDING_UNSAFE.get(n) for n in gm.graph.nodes if "embedding" in str(n.target)]
        assert got[0] is None and got[1] is not None and "table scales with tokens" in got[1], got


def test_slice_on_other_dims_stays_and_on_tokens_only_a_prefix() -> None:
    """RoPE's ``x[..., :d]`` (``aten.slice(x, 2, 0, d)``) is token-local; a prefix of the tokens is
    prefix-causal; a later start or a step shifts rows."""
    got = _verdicts(lambda x: (aten.slice.Tensor(x, 2, 0, 4), aten.slice.Tensor(x, -1, 4),
                               aten.slice.Tensor(x, 0, 0, -1), aten.slice.Tensor(x, 0, 1),
                               aten.slice.Tensor(x, 0, 0, None, 2), aten.slice(x, 2, 0, 4),
                               aten.slice(x, 0, 2)), _x())
    _assert(got, [("aten.slice.Tensor", None), ("aten.slice.Tensor", None), ("aten.slice.Tensor", None),
                  ("aten.slice.Tensor", "slices along the token dim"),
                  ("aten.slice.Tensor", "slices along the token dim"), ("aten.slice", None),
                  ("aten.slice", "slices along the token dim")])


def test_aten_narrow_prefix_is_prefix_causal() -> None:
    got = _verdicts(lambda x: (aten.narrow.default(x, 2, 1, 3), aten.narrow.default(x, 0, 0, 2),
                               aten.narrow.default(x, 0, 1, 2)), _x())
    _assert(got, [("aten.narrow.default", None), ("aten.narrow.default", None),
                  ("aten.narrow.default", "slices along the token dim")])


def test_a_causal_conv_tail_cut_off_by_an_aten_slice_stays() -> None:
    """``conv1d(x)[..., :n]`` in aten ops: the prefix slice cuts the conv's dirty tail off; without it
    the tail reaches the stage's outputs and the conv breaks."""
    weight = torch.randn(8, 1, 3)

    def conv(h: torch.Tensor) -> torch.Tensor:
        return aten.conv1d.default(aten.unsqueeze.default(aten.t.default(h), 0), weight, None, [1], [2],
                                   [1], 8)

    cut = _verdicts(lambda h: aten.slice.Tensor(conv(h), 2, 0, h.shape[0]), _h())
    assert all(reason is None for _, reason in cut), cut
    kept = _verdicts(conv, _h())
    assert next(r for op, r in kept if op == "aten.conv1d.default") is not None, kept


def test_metadata_asserts_are_no_ops() -> None:
    """``.to(dtype)`` exports as ``_assert_tensor_metadata`` then ``to.dtype``: both stay."""
    got = _verdicts(lambda h: (aten._assert_tensor_metadata.default(h, dtype=torch.float32),
                               aten.to.dtype(h, torch.float16), aten._to_copy.default(h, dtype=torch.float16),
                               aten.flip.default(h, [0])), _h())
    _assert(got, [("aten._assert_tensor_metadata.default", None), ("aten.to.dtype", None),
                  ("aten._to_copy.default", None), ("aten.flip.default", UNKNOWN)])


def test_elementwise_and_view_ops_of_an_exported_decoder() -> None:
    def f(h: torch.Tensor, x: torch.Tensor) -> Any:
        sq = aten.pow.Tensor_Scalar(h, 2)
        return (sq, aten.rsqrt.default(sq), aten.neg.default(h), aten.rsub.Scalar(h, 1),
                aten.clone.default(h), aten.alias.default(h),
                aten.copy_.default(aten.empty_like.default(h), h),
                aten.expand.default(aten.unsqueeze.default(h, 1), [-1, 3, -1]),
                aten.view.default(x, [-1, 32]), aten._unsafe_view.default(x, [-1, 32]),
                aten.reshape.default(aten.t.default(h), [-1]), aten.sym_size.int(x, 0),
                aten.flip.default(h, [0]))

    got = _verdicts(f, _h(), _x())
    ops = ["aten.pow.Tensor_Scalar", "aten.rsqrt.default", "aten.neg.default", "aten.rsub.Scalar",
           "aten.clone.default", "aten.alias.default", "aten.empty_like.default", "aten.copy_.default",
           "aten.unsqueeze.default", "aten.expand.default", "aten.view.default", "aten._unsafe_view.default",
           "aten.t.default", "aten.reshape.default"]
    verdicts: list[str | None] = [None] * 13 + ["across token rows"]
    want = list(zip(ops, verdicts))
    tail = [(op, r) for op, r in got if op not in ("aten.sym_size.int",)]
    _assert(tail, [*want, ("aten.flip.default", UNKNOWN)])
    assert all(r is None for op, r in got if op == "aten.sym_size.int"), got


def test_matrix_products_of_a_decomposed_linear() -> None:
    """``aten.linear`` decomposed: ``mm(x, t(w))`` and ``addmm(bias, x, t(w))`` stay; a product that
    contracts the tokens, or a weight that scales with them, breaks."""
    def f(h: torch.Tensor) -> Any:
        wt = aten.t.default(W)
        return (aten.linear.default(h, W, BIAS), aten.mm.default(h, wt), aten.addmm.default(BIAS, h, wt),
                aten.addmm.default(aten.mm.default(h, wt), h, wt),
                aten.baddbmm.default(BIAS, aten.unsqueeze.default(h, 0), aten.unsqueeze.default(wt, 0)),
                aten.linear.default(W, h), aten.mm.default(aten.t.default(h), h),
                aten.addmm.default(BIAS[:8], aten.t.default(h), h))

    got = _verdicts(f, _h())
    _assert(got, [("aten.t.default", None), ("aten.linear.default", None), ("aten.mm.default", None),
                  ("aten.addmm.default", None), ("aten.mm.default", None), ("aten.addmm.default", None),
                  ("aten.unsqueeze.default", None), ("aten.unsqueeze.default", None),
                  ("aten.baddbmm.default", None), ("aten.linear.default", "weight scales with tokens"),
                  ("aten.t.default", None), ("aten.mm.default", "contracts over the token dim"),
                  ("aten.t.default", None), ("aten.addmm.default", "contracts over the token dim")])


def test_reductions_read_dim_by_schema() -> None:
    """``aten.var.default(self, unbiased)`` has no ``dim``: it reduces every dim (``True`` is not dim
    1); ``mean.dim`` over features stays, over tokens breaks; so for softmax."""
    got = _verdicts(lambda h: (aten.mean.dim(h, [-1], True), aten.mean.dim(h, [0]),
                               aten.var.correction(h, [1]), aten.var.default(h, True), aten.var(h, True),
                               aten._softmax.default(h, -1, False), aten._softmax.default(h, 0, False),
                               aten.amax.default(h, [1]), aten.amax.default(h)), _h())
    _assert(got, [("aten.mean.dim", None), ("aten.mean.dim", "reduces along the token dim"),
                  ("aten.var.correction", None), ("aten.var.default", "every dim"),
                  ("aten.var", "every dim"), ("aten._softmax.default", None),
                  ("aten._softmax.default", "normalizes along the token dim"), ("aten.amax.default", None),
                  ("aten.amax.default", "token dim")])


def test_a_bool_where_torch_takes_a_dim_is_unbiased() -> None:
    """``x.var(True)``: every dim (``unbiased``), not dim 1."""
    ppcompile.mark_token_dynamic(h := _h())
    gm, example_inputs = dynamo_graph(lambda h: h.var(True) + h.var(dim=1).sum(), h, dynamic=False)
    gm = run_until(gm, make_ctx(gm, example_inputs), check_padding_safety)
    got = [PADDING_UNSAFE.get(n) for n in gm.graph.nodes if n.target == "var"]
    assert got[0] is not None and "every dim" in got[0] and got[1] is None, got


def test_cat_select_split_and_index_select() -> None:
    const = torch.tensor([1, 0])
    got = _verdicts(lambda x, ids: (
        aten.cat.default([x, x], -1), aten.cat.default([x, x]),
        aten.select.int(x, 1, 0), aten.select.int(x, 0, -1),
        aten.split_with_sizes.default(x, [3, 5], -1), aten.split_with_sizes.default(x, [2, x.shape[0] - 2]),
        aten.split.Tensor(x, 4, 2), aten.unbind.int(x, 1),
        aten.index_select.default(TABLE, 0, ids), aten.index_select.default(x, 0, const)), _x(), _ids())
    got = [(op, r) for op, r in got if op != "aten.sym_size.int"]
    _assert(got, [("aten.cat.default", None), ("aten.cat.default", "concatenates along the token dim"),
                  ("aten.select.int", None), ("aten.select.int", "selects along the token dim"),
                  ("aten.split_with_sizes.default", None),
                  ("aten.split_with_sizes.default", "splits along the token dim"),
                  ("aten.split.Tensor", None), ("aten.unbind.int", None),
                  ("aten.index_select.default", None),
                  ("aten.index_select.default", "gathers or scatters along the token dim")])


def test_advanced_indexing() -> None:
    """``aten.index`` (``x[idx]``): a table gathered by token-major indices, or a feature dim indexed,
    stays; token rows gathered break."""
    perm = torch.tensor([1, 0])
    got = _verdicts(lambda x, ids: (aten.index.Tensor(TABLE, [ids]), aten.index.Tensor(x, [None, None, perm]),
                                    aten.index.Tensor(x, [perm])), _x(), _ids())
    _assert(got, [("aten.index.Tensor", None), ("aten.index.Tensor", None),
                  ("aten.index.Tensor", "gathers along the token dim")])


def test_a_bool_mask_indexes_as_many_dims_as_it_has() -> None:
    """``x[:, mask]`` with a ``[heads, head_dim]`` mask indexes dims 1 and 2 (stays); a ``[tokens,
    heads]`` mask indexes the token dim (breaks)."""
    mask = torch.rand(4, 8) > 0.5
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        got = _verdicts(lambda x, m: (aten.index.Tensor(x, [None, mask]), aten.index.Tensor(x, [m])),
                        _x(), torch.rand(T, 4) > 0.5)
    got = [(op, r) for op, r in got if op == "aten.index.Tensor"]
    _assert(got, [("aten.index.Tensor", None), ("aten.index.Tensor", "gathers along the token dim")])


def test_norms() -> None:
    got = _verdicts(lambda h: (aten.rms_norm.default(h, [8]), aten.native_layer_norm.default(h, [8], None,
                                                                                             None, 1e-5),
                               aten.rms_norm.default(aten.t.default(h), [h.shape[0]])), _h())
    got = [(op, r) for op, r in got if op != "aten.sym_size.int"]
    _assert(got, [("aten.rms_norm.default", None), ("aten.native_layer_norm.default", None),
                  ("aten.t.default", None), ("aten.rms_norm.default", "normalizes along the token dim")])

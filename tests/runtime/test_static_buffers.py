"""Tests for ``ppcompile.runtime.static_buffers``: allocation, bucket views and copy-in."""

from __future__ import annotations

from typing import Any

import pytest
import sympy
import torch

from ppcompile.records import StaticBuffer
from ppcompile.runtime.static_buffers import allocate, bucket_view, copy_in, narrow_to
from ppcompile.symbolic import SizeFn

S = sympy.Symbol("s0", integer=True, positive=True)
TOKENS = SizeFn(S)


def _spec(shape: tuple[int, ...], token_dims: tuple[int, ...] = (0,)) -> StaticBuffer:
    return StaticBuffer("buf", "input", shape, torch.float32, torch.device("cpu"), token_dims)


def _env(n: int) -> dict[sympy.Symbol, int]:
    return {S: n}


def test_allocate_zero_filled_with_spec_shape_dtype() -> None:
    buf = allocate(StaticBuffer("b", "bridge", (16, 3), torch.float64, torch.device("cpu"), (0,)))
    assert buf.shape == (16, 3) and buf.dtype == torch.float64 and buf.device.type == "cpu"
    assert not buf.any()


def test_allocate_follows_the_callers_inference_mode() -> None:
    """Static buffers look like what eager would create in the same mode (Dynamo guards on it)."""
    with torch.inference_mode():
        buf = allocate(_spec((8, 4)))
        buf[2:4].fill_(3.0)
    assert buf.is_inference() and buf[2:4].eq(3.0).all()
    with torch.no_grad():
        plain = allocate(_spec((8, 4)))
    assert not plain.is_inference()
    plain[:2].copy_(torch.ones(2, 4))
    w = torch.ones(4, 4, requires_grad=True)
    (plain @ w).sum().backward()
    assert w.grad is not None and w.grad.sum().item() == 2 * 4 * 4


def test_copy_in_one_token_dim_zeroes_padding_only_up_to_bucket() -> None:
    buf = torch.full((16, 4), 7.0)
    src = torch.randn(5, 4)
    copy_in(buf, src, ((0, TOKENS),), _env(5), _env(8))
    torch.testing.assert_close(buf[:5], src)
    assert not buf[5:8].any()
    assert buf[8:].eq(7.0).all()  # beyond the bucket: untouched (no graph of this bucket reads it)


def test_copy_in_one_token_dim_not_leading() -> None:
    buf = torch.full((2, 16), 7.0)
    src = torch.randn(2, 3)
    copy_in(buf, src, ((1, TOKENS),), _env(3), _env(4))
    torch.testing.assert_close(buf[:, :3], src)
    assert not buf[:, 3:4].any()
    assert buf[:, 4:].eq(7.0).all()


def test_copy_in_exact_bucket_has_no_padding() -> None:
    buf = torch.full((8, 2), 7.0)
    src = torch.randn(8, 2)
    copy_in(buf, src, ((0, TOKENS),), _env(8), _env(8))
    torch.testing.assert_close(buf, src)


def test_copy_in_two_token_dims() -> None:
    buf = torch.full((16, 16), 7.0)
    src = torch.randn(3, 3)
    dims = ((0, TOKENS), (1, TOKENS))
    copy_in(buf, src, dims, _env(3), _env(4))
    torch.testing.assert_close(buf[:3, :3], src)
    block = buf[:4, :4].clone()
    block[:3, :3] = 0
    assert not block.any()  # the padded frame of the bucket block is zero
    assert buf[4:].eq(7.0).all() and buf[:, 4:].eq(7.0).all()


def test_copy_in_two_token_dims_with_expressions() -> None:
    buf = torch.full((16, 8), 7.0)
    src = torch.randn(5, 2)
    dims = ((0, TOKENS), (1, SizeFn(S // 2)))
    copy_in(buf, src, dims, _env(5), _env(8))
    torch.testing.assert_close(buf[:5, :2], src)
    frame = buf[:8, :4].clone()
    frame[:5, :2] = 0
    assert not frame.any()


def test_copy_in_without_token_dims_copies_everything() -> None:
    buf = torch.zeros(3, 4)
    src = torch.randn(3, 4)
    copy_in(buf, src, (), _env(2), _env(4))
    torch.testing.assert_close(buf, src)


def test_narrow_to_returns_views() -> None:
    buf = torch.arange(64.0).view(16, 4)
    v = narrow_to(buf, ((0, TOKENS),), _env(5))
    assert v.shape == (5, 4) and v.data_ptr() == buf.data_ptr()
    v.fill_(-1.0)
    assert buf[:5].eq(-1.0).all() and buf[5:].ne(-1.0).all()

    assert narrow_to(buf, ((0, TOKENS),), _env(16)) is buf  # full size: the buffer itself
    assert narrow_to(buf, (), _env(3)) is buf

    two = narrow_to(torch.zeros(16, 16), ((0, TOKENS), (1, SizeFn(S // 2))), _env(6))
    assert two.shape == (6, 3)


def test_allocate_keeps_the_traced_dim_order_so_bucket_views_keep_the_traced_strides() -> None:
    """A heads-first value [2, T, 4] laid out token-major (strides (4, 8, 1) at T = 16): the buffer has
    that memory order, and its view at a smaller bucket has the strides the trace gives for that bucket."""
    buf = allocate(_spec((2, 16, 4), token_dims=(1,)), strides=(4, 8, 1))
    assert buf.shape == (2, 16, 4) and buf.stride() == (4, 8, 1) and not buf.any()
    view = narrow_to(buf, ((1, TOKENS),), _env(8))
    assert view.stride() == (4, 8, 1)  # the traced strides at T = 8: (4, 2 * 4, 1)
    row_major = allocate(_spec((2, 16, 4), token_dims=(1,)))
    assert row_major.stride() == (64, 4, 1)


def test_allocate_keeps_strides_with_gaps_and_refuses_overlap() -> None:
    """Hidden states sliced from a [T, 2H] receive buffer have strides (2H, 1): the buffer keeps them at
    every bucket. Stride-0 dims (a broadcast input) would make rows share memory: dense instead."""
    buf = allocate(_spec((16, 4)), strides=(8, 1))
    assert buf.stride() == (8, 1) and not buf.any()
    assert narrow_to(buf, ((0, TOKENS),), _env(8)).stride() == (8, 1)
    broadcast = allocate(_spec((16, 4)), strides=(0, 1))
    assert 0 not in broadcast.stride() and broadcast.shape == (16, 4)


def test_bucket_view_gives_each_bucket_its_own_strides_when_they_follow_the_token_count() -> None:
    """A column-major [T, 4] (strides (1, T)): narrowing the largest bucket's buffer would keep stride 16
    at every bucket; the bucket view has the bucket's own (1, 8), in the same memory, and rows written
    through it are what a column-major [8, 4] holds."""
    buf = allocate(_spec((16, 4)), strides=(1, 16))
    view = bucket_view(buf, ((0, TOKENS),), _env(8), ((8, 4), (1, 8)), "x")
    assert view.stride() == (1, 8) and view.data_ptr() == buf.data_ptr()
    value = torch.arange(32.0).view(8, 4)
    view.copy_(value)
    assert torch.equal(buf.as_strided((32,), (1,)), value.t().flatten())  # column-major [8, 4] in memory
    assert bucket_view(buf, ((0, TOKENS),), _env(8)).stride() == (1, 16)  # narrowed: the largest's


@pytest.mark.parametrize(("layout", "problem"), [
    (((16, 8), (1, 16)), "needs more memory"),  # 128 elements in a buffer of 64
    (((4, 4), (1, 1)), "overlaps itself"),
])
def test_bucket_view_refuses_a_layout_the_buffer_cannot_hold(layout: Any, problem: str) -> None:
    buf = allocate(_spec((16, 4)), strides=(1, 16))
    with pytest.raises(RuntimeError, match=rf"static buffer of input 'x' cannot be viewed as shape "
                                           rf"\[{layout[0][0]}, {layout[0][1]}\].*{problem}"):
        bucket_view(buf, ((0, TOKENS),), _env(8), layout, "input 'x'")

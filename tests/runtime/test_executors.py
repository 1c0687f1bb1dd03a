"""Tests for ``ppcompile.runtime.executors``: the emulated and eager executors and ``make_executor``.

The CUDA graph executor is exercised under the strict CUDA-capture double in ``test_cuda_graph_double.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ppcompile.runtime.executors import (
    EagerExecutor,
    EmulatedGraphExecutor,
    ReplayAddressError,
    make_executor,
)

W = torch.arange(12.0).view(4, 3) / 10


def _segment(x: torch.Tensor, w: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A toy graph segment: two outputs computed from a static input, a parameter and a size."""
    y = x @ w
    return y, y.sum(dim=1, keepdim=True) * n


def test_emulated_capture_returns_outputs_of_fn() -> None:
    ex = EmulatedGraphExecutor()
    x = torch.randn(8, 4)
    outs = ex.capture((0, 8), _segment, (x, W, 8))
    want = _segment(x, W, 8)
    assert len(outs) == 2
    for got, exp in zip(outs, want):
        torch.testing.assert_close(got, exp)
    assert ex.num_captured() == 1 and ex.binds_inputs


def test_emulated_replay_reads_captured_inputs_only() -> None:
    ex = EmulatedGraphExecutor()
    x = torch.randn(8, 4)
    ex.capture((0, 8), _segment, (x, W, 8))

    x.copy_(torch.randn(8, 4))  # the runtime's copy-in: write the captured tensor in place
    outs = ex.replay((0, 8), (x, W, 8))
    for got, exp in zip(outs, _segment(x, W, 8)):
        torch.testing.assert_close(got, exp)

    # other tensors passed to replay are ignored: a graph reads only what it captured
    other = torch.randn(8, 4)
    outs = ex.replay((0, 8), (other, W, 8))
    for got, exp in zip(outs, _segment(x, W, 8)):
        torch.testing.assert_close(got, exp)
    assert not torch.allclose(outs[0], _segment(other, W, 8)[0])


def test_emulated_replay_writes_fixed_output_tensors() -> None:
    ex = EmulatedGraphExecutor()
    x = torch.randn(8, 4)
    captured = ex.capture((0, 8), _segment, (x, W, 8))
    ptrs = [o.data_ptr() for o in captured]
    first = ex.replay((0, 8), (x, W, 8))
    kept = first[0].clone()
    x.copy_(torch.randn(8, 4))
    second = ex.replay((0, 8), (x, W, 8))
    for a, b, c, p in zip(captured, first, second, ptrs):
        assert a is b is c and c.data_ptr() == p
    # the earlier replay's result was overwritten in place (valid only until the next replay)
    assert not torch.allclose(first[0], kept)
    torch.testing.assert_close(first[0], x @ W)


def test_emulated_keys_are_independent() -> None:
    ex = EmulatedGraphExecutor()
    x = torch.randn(16, 4)
    big = ex.capture((0, 16), _segment, (x, W, 16))
    small = ex.capture((0, 8), _segment, (x[:8], W, 8))
    assert ex.num_captured() == 2
    assert big[0].data_ptr() != small[0].data_ptr()
    x.copy_(torch.randn(16, 4))
    (y8, s8) = ex.replay((0, 8), ())
    torch.testing.assert_close(y8, x[:8] @ W)
    torch.testing.assert_close(s8, (x[:8] @ W).sum(1, keepdim=True) * 8)
    # bucket 16's outputs were not touched by the bucket-8 replay
    assert not torch.allclose(big[0][:8], y8)


def test_emulated_buckets_with_shapes_view_the_first_buckets_outputs() -> None:
    """Told each bucket's output shapes, smaller buckets capture leading views of the first (largest)
    capture's outputs without running the segment: one pool, outputs nobody holds."""
    ex = EmulatedGraphExecutor()
    x = torch.randn(16, 4)
    calls: list[int] = []

    def seg(t: torch.Tensor, w: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        calls.append(n)
        y = t @ w
        return y, y.sum(dim=1, keepdim=True) * n, 2 * n

    big = ex.capture((0, 16), seg, (x, W, 16), [(16, 3), (16, 1), 32])
    small = ex.capture((0, 8), seg, (x[:8], W, 8), [(8, 3), (8, 1), 16])
    assert calls == [16]  # the smaller bucket did not run
    assert small[2] == 16 and all(
        s.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and s.shape[0] == 8
        for s, b in zip(small[:2], big[:2]))
    x.copy_(torch.randn(16, 4))
    y8, s8, n8 = ex.replay((0, 8), ())
    assert n8 == 16
    torch.testing.assert_close(y8, x[:8] @ W)
    torch.testing.assert_close(s8, (x[:8] @ W).sum(1, keepdim=True) * 8)
    torch.testing.assert_close(big[0][:8], y8)  # the bucket-8 replay wrote bucket 16's memory


@pytest.mark.parametrize("case", ["aliases an input", "shapes disagree", "shape unknown", "grows"])
def test_emulated_segments_that_cannot_share_run_at_every_bucket(case: str) -> None:
    ex = EmulatedGraphExecutor()
    x = torch.randn(16, 4)
    calls: list[int] = []

    def seg(t: torch.Tensor) -> tuple[torch.Tensor]:
        calls.append(t.shape[0])
        return (t.view(-1) if case == "aliases an input" else t * 2,)

    first = {"aliases an input": (64,), "shapes disagree": (16, 5), "shape unknown": None,
             "grows": (16, 4)}[case]
    ex.capture((0, 16), seg, (x,), [first])
    second = (32, 4) if case == "grows" else (8, 4) if first is None or len(first) == 2 else (32,)
    (out,) = ex.capture((0, 8), seg, (x[:8],), [second])
    assert calls == [16, 8] and out.shape[0] == (32 if case == "aliases an input" else 8)
    x.copy_(torch.randn(16, 4))
    (again,) = ex.replay((0, 8), ())
    torch.testing.assert_close(again, x[:8].view(-1) if case == "aliases an input" else x[:8] * 2)


def test_emulated_replay_of_unknown_key_raises() -> None:
    ex = EmulatedGraphExecutor()
    with pytest.raises(KeyError):
        ex.replay((0, 4), ())


def test_emulated_debug_rejects_other_inputs_naming_the_input() -> None:
    ex = EmulatedGraphExecutor(debug=True)
    x = torch.randn(8, 4)
    ex.capture((3, 8), _segment, (x, W, 8))
    ex.replay((3, 8), (x, W, 8))  # same tensors: fine
    ex.replay((3, 8), (x.view(8, 4), W, 8))  # another view of the same address and layout: fine
    with pytest.raises(ReplayAddressError, match=r"segment 3 at bucket 8 .*input 0"):
        ex.replay((3, 8), (torch.randn(8, 4), W, 8))
    with pytest.raises(ReplayAddressError, match=r"input 1"):
        ex.replay((3, 8), (x, W.clone(), 8))
    with pytest.raises(ReplayAddressError, match=r"input 0"):
        ex.replay((3, 8), (x[:4], W, 8))  # same address, other shape
    with pytest.raises(ReplayAddressError, match=r"input 0"):
        ex.replay((3, 8), (None, W, 8))
    assert issubclass(ReplayAddressError, RuntimeError)


def test_emulated_without_debug_ignores_other_inputs() -> None:
    ex = EmulatedGraphExecutor(debug=False)
    x = torch.randn(8, 4)
    ex.capture((0, 8), _segment, (x, W, 8))
    outs = ex.replay((0, 8), (torch.randn(8, 4), W.clone(), 8))
    torch.testing.assert_close(outs[0], x @ W)


def test_emulated_output_aliasing_an_input() -> None:
    """A segment that returns a view of its input: replay must not break the alias."""

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.view(-1), x * 2

    ex = EmulatedGraphExecutor()
    x = torch.randn(2, 3)
    ex.capture((0, 2), fn, (x,))
    x.copy_(torch.ones(2, 3))
    flat, doubled = ex.replay((0, 2), ())
    torch.testing.assert_close(flat, torch.ones(6))
    torch.testing.assert_close(doubled, torch.full((2, 3), 2.0))


def test_eager_executor_returns_fresh_outputs_from_given_args() -> None:
    ex = EagerExecutor()
    assert not ex.binds_inputs
    x = torch.randn(8, 4)
    captured = ex.capture((0, 8), _segment, (x, W, 8))
    for got, exp in zip(captured, _segment(x, W, 8)):
        torch.testing.assert_close(got, exp)
    assert ex.num_captured() == 1

    other = torch.randn(5, 4)
    outs = ex.replay((0, 8), (other, W, 5))
    for got, exp in zip(outs, _segment(other, W, 5)):
        torch.testing.assert_close(got, exp)
    again = ex.replay((0, 8), (other, W, 5))
    assert all(a is not b and a.data_ptr() != b.data_ptr() for a, b in zip(outs, again))
    assert all(a is not c for a, c in zip(outs, captured))


def test_make_executor_modes() -> None:
    assert isinstance(make_executor("emulate", False), EmulatedGraphExecutor)
    ex: Any = make_executor("eager", True)
    assert isinstance(ex, EagerExecutor) and ex.debug
    assert make_executor("emulate", True).debug


@pytest.mark.parametrize("mode", ["auto", "none", "CUDA", ""])
def test_make_executor_rejects_unknown_modes(mode: str) -> None:
    with pytest.raises(ValueError, match=repr(mode).replace("(", r"\(")):
        make_executor(mode, False)


def test_release_drops_captured_graphs() -> None:
    ex = EmulatedGraphExecutor()
    x = torch.randn(8, 4)
    ex.capture((0, 8), _segment, (x, W, 8))
    ex.capture((2, 8), _segment, (x, W, 8))
    ex.release()
    assert ex.num_captured() == 0
    with pytest.raises(KeyError):
        ex.replay((0, 8), ())


def test_emulated_replay_of_an_expanded_output() -> None:
    """A segment returning a stride-0 view (``expand``) still replays into its captured output."""
    ex = EmulatedGraphExecutor()
    x = torch.arange(4.0)

    def seg(t: torch.Tensor) -> tuple[torch.Tensor]:
        return (t[:, None].expand(-1, 3),)

    (out,) = ex.capture((0, 4), seg, (x,))
    x.add_(10)
    (again,) = ex.replay((0, 4), ())
    assert again is out
    torch.testing.assert_close(out, (torch.arange(4.0) + 10)[:, None].expand(-1, 3))


def _token_inner(x: torch.Tensor) -> tuple[torch.Tensor]:
    """A segment whose output keeps the token dim inner: ``[3, T]`` row-major (row stride T)."""
    return ((x @ W).t().contiguous(),)


def test_emulated_buckets_share_outputs_only_where_a_view_has_the_buckets_own_strides() -> None:
    ex = EmulatedGraphExecutor()
    x16, x8 = torch.randn(16, 4), torch.randn(8, 4)
    big = ex.capture((0, 16), _token_inner, (x16,), [(3, 16)], [(16, 1)])
    # Bucket 8 wants strides (8, 1): a view of bucket 16's output has (16, 1), so it gets its own.
    (small,) = ex.capture((0, 8), _token_inner, (x8,), [(3, 8)], [(8, 1)])
    assert small.stride() == (8, 1)
    assert small.untyped_storage().data_ptr() != big[0].untyped_storage().data_ptr()
    # Without strides (an executor caller that cannot tell), the view is taken as before.
    ex2 = EmulatedGraphExecutor()
    big2 = ex2.capture((0, 16), _token_inner, (x16,), [(3, 16)])
    (view,) = ex2.capture((0, 8), _token_inner, (x8,), [(3, 8)])
    assert view.stride() == (16, 1)
    assert view.untyped_storage().data_ptr() == big2[0].untyped_storage().data_ptr()
    x8.copy_(torch.randn(8, 4))
    torch.testing.assert_close(ex.replay((0, 8), ())[0], _token_inner(x8)[0])

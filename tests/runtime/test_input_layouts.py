"""Live inputs that are not contiguous: every graph mode, both segment compilers, several dtypes.

The stage's inputs are what a PP receive hands over: hidden states and residual as column slices of one
``[T, 2H]`` buffer (strides ``[2H, 1]``) and token ids as a column of a ``[T, 2]`` tensor. Their static
buffers take the traced strides when Inductor segments were compiled for them (``static_buffers.allocate``),
so those segments read them correctly at every bucket; copy-in fills them from whatever layout a call
brings.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from mixer_stage import register_mixer

import ppcompile

H = 8
pytestmark = pytest.mark.usefixtures("fresh_dynamo", "one_thread")

mixer = register_mixer("pptest_layouts::mixer", lambda x: None)


class ReceivedStage(torch.nn.Module):
    """graph (embed ids, up) | break (mixer) | graph (down, residual)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(32, H).to(dtype)
        self.up, self.down = torch.nn.Linear(H, 2 * H).to(dtype), torch.nn.Linear(2 * H, H).to(dtype)

    def forward(self, ids: torch.Tensor, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = mixer(torch.relu(self.up(x + residual + self.embed(ids))))
        out = self.down(h)
        return out, out + residual


def _received(n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    recv = torch.randn(n, 2 * H, generator=g).to(dtype)
    ids = torch.randint(0, 32, (n, 2), generator=g)[:, 1]
    x, residual = recv[:, :H], recv[:, H:]
    assert x.stride() == (2 * H, 1) and ids.stride() == (2,)
    ppcompile.mark_token_dynamic(ids, x, residual)
    return ids, x, residual


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("mode", ["emulate", "eager", "none"])
def test_strided_live_inputs_match_eager_on_every_path(mode: str, compiler: str, dtype: torch.dtype) -> None:
    m = ReceivedStage(dtype)
    options: dict[str, Any] = {"graph_mode": mode, "segment_compiler": compiler, "capture_sizes": [4, 8]}
    c = torch.compile(m, backend="pp_breakable", options=options)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    graphed = mode != "none"
    # 1 token (padding guard: eager), exactly a bucket, a bucket + 1, above the cap, then a bucket again.
    counts = [1, 8, 5, 9, 4, 7]
    with torch.no_grad(), ppcompile.counters.expect(replays=4 if graphed else 0):
        for i, n in enumerate(counts):
            inputs = _received(n, dtype, seed=i)
            for got, want in zip(c(*inputs), m(*inputs)):
                torch.testing.assert_close(got, want, **tol)
    if graphed:
        (runtime,) = [rt for rt in ppcompile.stage_runtimes() if rt.token_symbol is not None]
        (state,) = runtime.instances()
        assert state.captured_buckets == (4, 8)
        strides = sorted(buf.stride() for buf in state.input_buffers.values())
        if compiler == "inductor":  # compiled for the traced strides: the buffers keep them, gaps too
            assert strides == [(2,), (2 * H, 1), (2 * H, 1)]
        else:  # FX code reads any layout: dense buffers
            assert strides == [(1,), (H, 1), (H, 1)]


def test_contiguous_calls_after_a_strided_first_call_copy_into_the_traced_layout() -> None:
    """The buffers follow the first call's traced strides; a later contiguous call (a new trace or
    not, as Dynamo decides) still matches eager."""
    m = ReceivedStage(torch.float32)
    c = torch.compile(m, backend="pp_breakable", options={"graph_mode": "emulate", "capture_sizes": [4, 8]})
    with torch.no_grad():
        for i, n in enumerate([6, 3]):
            ids, x, residual = _received(n, torch.float32, seed=i)
            for inputs in ((ids, x, residual), (ids.contiguous(), x.contiguous(), residual.contiguous())):
                ppcompile.mark_token_dynamic(*inputs)
                for got, want in zip(c(*inputs), m(*inputs)):
                    torch.testing.assert_close(got, want)
    assert ppcompile.counters.replays == 4


def _column_major(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, hidden states and residual whose token dim is the inner one in memory (strides
    ``[1, T]``): their traced strides follow the token count."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32, (n,), generator=g)
    x, residual = (torch.randn(H, n, generator=g).t() for _ in range(2))
    assert x.stride() == (1, n)
    ppcompile.mark_token_dynamic(ids, x, residual)
    return ids, x, residual


@pytest.mark.parametrize("copy_kernel", ["torch", "triton"])
@pytest.mark.parametrize("mode", ["emulate", "eager"])
def test_column_major_inputs_get_each_buckets_strides_and_graphs_serve(
    mode: str, copy_kernel: str, request: pytest.FixtureRequest
) -> None:
    """Inductor segments compiled for strides ``[1, s0]`` read, at bucket b, a view with strides
    ``[1, b]`` of the buffer made for the largest bucket; a fused copier leaves those buffers to torch
    ops (it binds one layout) and copies the rest."""
    if copy_kernel == "triton":
        request.getfixturevalue("interpret")
    m = ReceivedStage(torch.float32)
    options = {"graph_mode": mode, "segment_compiler": "inductor", "capture_sizes": [4, 8],
               "copy_kernel": copy_kernel}
    c = torch.compile(m, backend="pp_breakable", options=options)
    with torch.no_grad(), ppcompile.counters.expect(replays=4):
        for i, n in enumerate([1, 8, 5, 9, 4, 7]):
            inputs = _column_major(n, seed=i)
            for got, want in zip(c(*inputs), m(*inputs)):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    (runtime,) = [rt for rt in ppcompile.stage_runtimes() if rt.token_symbol is not None]
    (state,) = runtime.instances()
    assert sorted(buf.stride() for buf in state.input_buffers.values()) == [(1,), (1, 8), (1, 8)]
    views = {t.stride() for t in state.static_tensors() if t.dim() == 2 and t.shape[0] == 4}
    assert (1, 4) in views
    assert state.copy_kernel == copy_kernel

"""Real CUDA graphs: a small stage compiled on a CUDA device, graph path against eager across token counts.

Skipped without CUDA (the CPU suite covers the same runtime with the emulated executor and a mocked CUDA
graph API under the strict capture double, ``test_cuda_graph_double.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from mixer_stage import MixerStage, register_mixer
from runtime_helpers import executors_made_by, symbolic_runtime
from torch import nn

import ppcompile
from ppcompile import counters
from ppcompile.runtime.executors import CudaGraphExecutor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

H = 64
SIZES = [4, 8, 16, 32]
seen_rows: list[int] = []


register_mixer("pptest_rt::gpu_mixer", lambda x: seen_rows.append(x.shape[0]))


@pytest.fixture(autouse=True)
def _fresh(fresh_dynamo: None) -> Iterator[None]:
    """Fresh Dynamo and counters (tests/conftest.py), no rows seen yet, no autograd."""
    seen_rows.clear()
    with torch.no_grad():
        yield


def _stage() -> MixerStage:
    return MixerStage(torch.ops.pptest_rt.gpu_mixer, H).cuda()


def _compile(m: nn.Module, **options: Any) -> Any:
    opts = {"capture_sizes": SIZES, "split_ops": ["pptest_rt::gpu_mixer"], **options}
    return torch.compile(m, backend="pp_breakable", dynamic=True, fullgraph=True, options=opts)


def _inputs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(n, H, device="cuda", generator=g), torch.randn(n, H, device="cuda", generator=g))



@pytest.mark.parametrize("mode", ["auto", "cuda"])
def test_cuda_graphs_match_eager_across_token_counts(mode: str) -> None:
    m = _stage()
    c = _compile(m, graph_mode=mode)
    counts = [5, 1, 4, 8, 9, 16, 17, 32, 33, 40, 3, 12, 5]
    for i, n in enumerate(counts):
        args = _inputs(n, seed=i)
        seen_rows.clear()
        got = c(*args)
        assert seen_rows == [n]
        want = m(*args)
        for g, w in zip(got, want):
            assert g.is_cuda and g.shape == w.shape == (n, H)
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    rt = symbolic_runtime(m)
    assert rt.graph_mode == "cuda"
    (state,) = rt.instances()
    assert isinstance(state.executor, CudaGraphExecutor)
    assert state.executor.num_captured() == 2 * len(SIZES)
    assert next(iter(state.executor._captured))[1] == max(SIZES)  # largest bucket captured first
    graphed = [n for n in counts if rt.plan.bucket(n) is not None and n != 1]
    assert counters.replays == len(graphed)
    assert counters.captures == 2 * len(SIZES)


def test_cuda_graph_views_valid_until_next_call_and_owned_outputs_by_default() -> None:
    m = _stage()
    c = _compile(m, owned_outputs=False)
    first, _ = c(*_inputs(5, seed=1))
    kept = first.clone()
    second, _ = c(*_inputs(6, seed=2))  # same bucket: overwrites the static output
    torch.cuda.synchronize()
    torch.testing.assert_close(first, second[:5])
    assert not torch.allclose(first, kept)

    for options in ({}, {"owned_outputs": True}):  # the default, and asked for
        torch._dynamo.reset()
        c = _compile(m, **options)
        first, _ = c(*_inputs(5, seed=1))
        kept = first.clone()
        c(*_inputs(6, seed=2))
        torch.cuda.synchronize()
        assert torch.equal(first, kept)


def test_cuda_graphs_under_inference_mode() -> None:
    m = _stage()
    c = _compile(m)
    with torch.inference_mode():
        for i, n in enumerate([7, 16, 3, 30]):
            args = _inputs(n, seed=i)
            for g, w in zip(c(*args), m(*args)):
                torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    assert counters.replays == 4 and counters.eager_runs == 0


def _pool_bytes(pool: Any) -> int:
    """Bytes of the CUDA caching allocator's segments that belong to the graph pool ``pool``."""
    segments = torch.cuda.memory_snapshot()
    if segments and "segment_pool_id" not in segments[0]:
        pytest.skip("this torch's memory snapshot does not name segment pools")
    return sum(s["total_size"] for s in segments if tuple(s["segment_pool_id"]) == tuple(pool))


class _HoldsEveryBucket(CudaGraphExecutor):
    """CUDA graphs whose outputs stay held strongly after their bucket is captured (no block reuse)."""

    def bucket_captured(self, bucket: int) -> dict[int, Any]:
        return {}


def _holds_every_bucket(mode: str, debug: bool, device: Any, agreement: Any) -> CudaGraphExecutor:
    return _HoldsEveryBucket(debug, device=device, agreement=agreement)


def test_buckets_share_the_graph_pool() -> None:
    """Graph outputs are held weakly once their bucket is captured, so smaller buckets capture into
    the larger ones' blocks: the pool holds about one bucket's outputs, not every bucket's."""

    width, sizes = 512, [512, 1024, 2048, 3072, 4096, 6144, 8192]

    def run(share: bool) -> int:
        torch._dynamo.reset()
        torch.manual_seed(0)
        m = MixerStage(torch.ops.pptest_rt.gpu_mixer, width).cuda()  # MiBs of outputs per bucket
        with contextlib.ExitStack() as stack:
            if not share:
                stack.enter_context(executors_made_by(_holds_every_bucket))
            c = _compile(m, capture_sizes=sizes)
            for i, n in enumerate([8000, 700, 3000, 8192, 513, 5000]):  # across buckets, interleaved
                g = torch.Generator(device="cuda").manual_seed(i)
                args = tuple(torch.randn(n, width, device="cuda", generator=g) for _ in range(2))
                for got, want in zip(c(*args), m(*args)):
                    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
        (state,) = symbolic_runtime(m).instances()
        return _pool_bytes(state.executor.pool)

    held = run(share=False)
    shared = run(share=True)
    assert 0 < shared <= 0.7 * held, (shared, held)


def test_event_fences_let_a_side_stream_send_ring_outputs_without_host_syncs() -> None:
    """output_slots=2 and an engine loop that copies each forward's outputs on a second stream (a send)
    and hands the copy's event to ``fence_outputs``: forward i + 2 waits for it on the device, the loop
    never synchronises (CUDA's sync debug mode raises on any host sync), and every copy equals eager."""
    m = _stage()
    c = _compile(m, graph_mode="cuda", output_slots=2)
    side = torch.cuda.Stream()
    counts = [5, 8, 9, 16, 3, 32, 7, 12]
    for n in SIZES:  # captures every bucket before the loop
        c(*_inputs(n, 0))
    torch.cuda.synchronize()
    sent, want = [], []
    with counters.expect(fence_waits={"event": len(counts) - 2}):
        torch.cuda.set_sync_debug_mode("error")
        try:
            for i, n in enumerate(counts):
                x, r = _inputs(n, i)
                out = c(x, r)
                want.append(m(x, r))
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    sent.append(tuple(torch.empty_like(t).copy_(t, non_blocking=True) for t in out))
                    event = side.record_event()
                assert ppcompile.fence_outputs(out, event) == 1
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    for got, exp in zip(sent, want):
        for g, e in zip(got, exp):
            torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)

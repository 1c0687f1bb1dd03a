"""A one-rank NCCL tensor-parallel stage on a GPU: its all-reduce is captured in CUDA graphs and replayed.

A TP stage's all-reduces stay in graph segments (``find_collectives``); on a GPU that means NCCL work
recorded by ``torch.cuda.CUDAGraph`` and replayed with the segment's kernels. One GPU holds a world of
one rank, so this checks the half of it that one rank can: the capture takes ProcessGroupNCCL's work
(on the capture stream, or on its own stream joined back, with no host sync), the graphs replay with
the collective inside and read their static buffers, eager forwards on the same communicator mix with
the replays, and every answer equals eager's. What only several GPUs can check (every rank capturing
and replaying the same graphs in the same order) is listed in docs/benchmarks.md.

The stage is ``tp_toy.ToyTP`` with ``force_collective`` (it calls its all-reduce at size 1 too), in each
of its styles. The default process group is initialised here for one rank from an in-memory store and
destroyed at the end of the module, after the graphs are freed (a communicator waits for the graphs that
captured it). Skipped without CUDA or NCCL.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from attention_modules import CFG
from tp_toy import CUSTOM_OPS, STYLES, ToyTP

import ppcompile
from ppcompile.models import make_forward_context, set_forward_context

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not dist.is_available() or not dist.is_nccl_available(),
                       reason="needs torch.distributed with NCCL"),
]

DEVICE = torch.device("cuda", 0)
GRAPH_MODE = "cuda"
LAYERS = (3, 4)  # global layer ids: two attention breaks
SIZES = [8, 16]
COUNTS = (1, 8, 9, 16, 17, 40)  # 1 (its padding guard), a bucket, a bucket + 1, the cap, above the cap
PATHS = ["eager", "graph", "graph", "graph", "eager", "eager"]
FRESH = (12, (100, 101))  # a token count replayed twice, and the seeds of its two inputs
DESTROY_S = 30.0


def _destroy_within(seconds: float) -> None:
    """``destroy_process_group()``, failing instead of hanging when it does not return in ``seconds``."""
    errors: list[BaseException] = []

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except BaseException as e:  # reported by the caller
            errors.append(e)

    thread = threading.Thread(target=destroy, name="destroy_process_group", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise RuntimeError(f"destroy_process_group() did not return in {seconds:g} s: a CUDA graph that "
                           "captured NCCL work is still alive, or a collective is stuck")
    if errors:
        raise errors[0]


@pytest.fixture(scope="module")
def world() -> Iterator[Any]:
    """A one-rank NCCL default group on ``DEVICE``, its communicator initialised before any capture."""
    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    torch.cuda.set_device(DEVICE)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=DEVICE,
                            timeout=datetime.timedelta(seconds=60))
    try:
        warm = torch.ones(1, device=DEVICE)
        dist.all_reduce(warm)  # the communicator exists before the first capture
        torch.cuda.synchronize(DEVICE)
        assert warm.item() == 1.0
        yield dist.group.WORLD
    finally:
        torch._dynamo.reset()  # the runtimes and their graphs go before the communicator
        gc.collect()
        torch.cuda.synchronize(DEVICE)
        _destroy_within(DESTROY_S)


@pytest.fixture(autouse=True)
def _fresh(fresh_dynamo: None) -> Iterator[None]:
    """Fresh Dynamo and counters (tests/conftest.py); the graphs of a test freed before the next."""
    yield
    torch._dynamo.reset()
    gc.collect()


def _context(n: int) -> contextlib.AbstractContextManager[object]:
    return set_forward_context(make_forward_context([n], CFG, LAYERS, device=DEVICE))


def _inputs(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, CFG.hidden_size, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _assert_close(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"{where}: {m}")


def _calls_all_reduce(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls an all-reduce: a functional or declared one, or one that a higher-order op
    (``auto_functionalized``) wraps."""
    ops = [node.target, *(a for a in node.args if not isinstance(a, torch.fx.Node))]
    return node.op == "call_function" and any("all_reduce" in str(op) for op in ops)


def _collective_segments(runtime: Any) -> list[str]:
    """The graph segments whose FX code calls an all-reduce."""
    found = []
    for segment in runtime.segments:
        module = getattr(runtime.split_module, segment.name, None)
        if segment.is_graph and isinstance(module, torch.fx.GraphModule) and any(
                _calls_all_reduce(n) for n in module.graph.nodes):
            found.append(segment.name)
    return found


@pytest.mark.parametrize("style", STYLES)
def test_one_rank_nccl_all_reduce_is_captured_and_replays_like_eager(world: Any, style: str) -> None:
    reference = ToyTP(LAYERS).to(DEVICE)  # the same weights, no collective (one rank: a sum of one)
    model = ToyTP(LAYERS, style=style, group=world, force_collective=True).to(DEVICE)  # last: its group
    options: dict[str, Any] = {"graph_mode": GRAPH_MODE, "capture_sizes": SIZES}
    if style.startswith("custom"):
        options |= {"collective_ops": list(CUSTOM_OPS), "tp_group": world}
    compiled = torch.compile(model, backend="pp_breakable", options=options)
    paths, answers = [], []
    with torch.inference_mode():
        calls = [(n, n) for n in COUNTS] + [(FRESH[0], seed) for seed in FRESH[1]]
        for n, seed in calls:
            x = _inputs(n, seed)
            ppcompile.mark_token_dynamic(x)
            replays, eager = ppcompile.counters.replays, ppcompile.counters.eager_runs
            with _context(n):
                got = compiled(x).clone()  # graph outputs live in static buffers until the next call
            with _context(n):
                want = reference(x)
            paths.append("graph" if ppcompile.counters.replays == replays + 1 else
                         "eager" if ppcompile.counters.eager_runs > eager else "other")
            _assert_close(got, want, f"{style} n={n} seed={seed}")
            answers.append(got)
    # (b) the graph path served a bucket, the bucket + 1, the cap and both fresh inputs; the rest ran eagerly
    assert paths == [*PATHS, "graph", "graph"], paths
    assert dict(ppcompile.counters.replays_by_bucket) == {8: 1, 16: 4}  # 8 | 9, 16, 12, 12
    # (d) two replays of one bucket with fresh inputs: fresh answers (the graphs read the static buffers)
    assert not torch.allclose(answers[-1], answers[-2])
    (runtime,) = [rt for rt in ppcompile.runtimes_of(model) if rt.token_symbol is not None]
    assert runtime.graph_mode == GRAPH_MODE
    # (a) the all-reduces stay in graph segments: one break per layer (the attention), no more
    kinds = [s.kind for s in runtime.segments]
    assert kinds.count("break") == len(LAYERS), kinds
    assert runtime.compiled.collectives and all(c.unsafe is None for c in runtime.compiled.collectives)
    with_collective = _collective_segments(runtime)
    assert len(with_collective) == len(LAYERS), (with_collective, kinds)
    graphs = kinds.count("graph")
    assert ppcompile.counters.captures == graphs * len(SIZES), (ppcompile.counters.captures, kinds)
    assert {i: sorted(b) for i, b in runtime.captured_buckets().items()} == {0: SIZES}  # one instance
    assert runtime.agreement.size == 1 and runtime.agreement.collectives == 0  # one rank: nothing to agree
    assert not runtime.fall_offs(), runtime.fall_offs()

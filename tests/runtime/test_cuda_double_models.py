"""The CUDA path on whole stages, under the strict capture double (``tests/cuda_double.py``).

The reference decoders (dense, MoE, top-k proxies, the engine-style attention ops: functional and
out-variant ``ppcompile::attention``, vLLM's in-place ``fused_add_rms_norm``; dense and MoE also with
stamped layers) and the Hugging Face families, compiled with ``graph_mode="emulate"`` (the graph path on
CPU tensors), whose executors the double's factory makes: ``CudaGraphExecutor`` captures every bucket
with captures that run nothing and refuse what real capture refuses, and each stage equals eager at 1
token, every bucket exactly, every bucket + 1, and above the cap. A capture run flushes the allocator
cache once.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from cuda_double import StrictCuda
from reference_runs import run_hf_stage, run_middle_stage

import ppcompile
from ppcompile.models import REFERENCE_CONFIGS, make_batch, make_stage
from ppcompile.pipeline import InProcessPipeline
from ppcompile.runtime.executors import CudaGraphExecutor

SIZES = [4, 8, 16, 32]
GRAPHED = {"graph_mode": "emulate"}  # the graph path; strict_cuda.factory serves it with CUDA graphs
# 1 token (Dynamo specialises it: eager), each bucket exactly and + 1, above the cap.
COUNTS = [1, *(n for b in SIZES for n in (b, b + 1) if n <= SIZES[-1]), SIZES[-1] + 1]
ATOL = 1e-5

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "one_thread")


@pytest.fixture(autouse=True)
def _inference() -> Iterator[None]:
    with torch.inference_mode():
        yield


def _cuda_runtimes(old: list[object]) -> list[object]:
    runtimes = [rt for rt in ppcompile.stage_runtimes() if not any(rt is o for o in old)]
    return [rt for rt in runtimes if rt.token_symbol is not None and rt.eager_reason is None]


def _copies(kw: dict[str, object]) -> dict[str, object]:
    """``kw`` with its tensors (and proxy tensors) cloned."""
    out: dict[str, object] = {}
    for key, value in kw.items():
        if isinstance(value, torch.Tensor):
            out[key] = value.clone()
        elif value is not None and hasattr(value, "keys"):
            out[key] = type(value)({k: value[k].clone() for k in value})  # type: ignore[call-arg]
        else:
            out[key] = value
    return out


def _assert_close(got: object, want: object, what: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        if want.is_floating_point():
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m: f"{what}: {m}")
        else:
            assert torch.equal(got, want), what
        return
    assert isinstance(got, dict) or hasattr(got, "keys")
    for key in want:  # type: ignore[attr-defined]
        _assert_close(got[key], want[key], f"{what}[{key}]")  # type: ignore[index]


@pytest.mark.parametrize("cfg_name", ["small-dense", "small-moe", "topk", "out-variant", "in-place-norm"])
def test_reference_stages_capture_and_match_eager_at_every_bucket(strict_cuda: StrictCuda,
                                                                  cfg_name: str) -> None:
    cfg = REFERENCE_CONFIGS[cfg_name].replace(num_layers=4)
    old = ppcompile.stage_runtimes()
    eager = InProcessPipeline(cfg, 2, compiled=False)
    graphed = InProcessPipeline(cfg, 2, compiled=True, options={"capture_sizes": SIZES, **GRAPHED})
    for n in COUNTS:
        ids, pos, _ = make_batch(cfg, [n], 0, 2, seed=n)
        proxies: object = None
        for rank in range(2):
            kw = {"input_ids": ids} if rank == 0 else {"pp_proxy_tensors": proxies}
            want = eager.run_stage(rank, pos, [n], **_copies(kw))  # in-place norms write their inputs
            bucket = next((b for b in SIZES if b >= n), None) if n > 1 else None
            expect = ({"replays": 1, "replays_by_bucket": {bucket: 1}} if bucket is not None
                      else {"replays": 0, "eager_runs": 1})
            with ppcompile.counters.expect(**expect):
                got = graphed.run_stage(rank, pos, [n], **_copies(kw))
            _assert_close(got, want, f"{cfg_name} stage {rank} at {n} tokens")
            proxies = want
    runtimes = _cuda_runtimes(old)
    assert len(runtimes) == 2
    for rt in runtimes:
        (state,) = rt.instances()
        assert isinstance(state.executor, CudaGraphExecutor) and state.captured_buckets == tuple(SIZES)
    assert strict_cuda.flushes == 2  # one capture run per stage, one flush each
    assert all(g.replays >= 1 for g in strict_cuda.graphs)


@pytest.mark.parametrize("cfg_name", ["small-dense", "small-moe"])
def test_stamped_stages_capture_and_match_eager_at_every_bucket(strict_cuda: StrictCuda,
                                                                cfg_name: str) -> None:
    """``trace_layers_once``: the stamped layers' copies of the exemplar's ops, reading their own
    weights (graph inputs bound by the runtime), captured and replayed."""
    cfg = REFERENCE_CONFIGS[cfg_name].replace(num_layers=12)
    stage = ppcompile.trace_layers_once(make_stage(cfg, 1, 3), stamp=True)
    got, want, runtime = run_middle_stage(stage, cfg, {"capture_sizes": SIZES, **GRAPHED}, COUNTS)
    for n, g, w in zip(COUNTS, got, want):
        _assert_close(g, w, f"stamped {cfg_name} at {n} tokens")
    assert runtime.compiled.record.stamped_layers == 3 and runtime.compiled.bound_inputs
    (state,) = runtime.instances()
    assert isinstance(state.executor, CudaGraphExecutor) and state.captured_buckets == tuple(SIZES)
    assert strict_cuda.flushes == 1 and all(g.replays >= 1 for g in strict_cuda.graphs)


transformers = pytest.importorskip("transformers")
from ppcompile.models.hf import TINY_FAMILIES, HFStage, make_hf_stages, tiny_causal_lm  # noqa: E402


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_hf_stages_capture_and_match_eager_at_every_bucket(strict_cuda: StrictCuda, family: str) -> None:
    if getattr(transformers, TINY_FAMILIES[family][0], None) is None:
        pytest.skip(f"transformers {transformers.__version__} has no {TINY_FAMILIES[family][0]}")
    model = tiny_causal_lm(family, num_hidden_layers=2)
    old = ppcompile.stage_runtimes()
    options = {"capture_sizes": SIZES[:3], **GRAPHED}
    stages = [torch.compile(s, backend="pp_breakable", dynamic=True, options=options)
              for s in make_hf_stages(model, 2)]
    for n in [8, 1, 4, 5, 9, 16, 17]:
        ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n))
        positions = torch.arange(n)
        proxies = stages[0](ids, positions)
        logits = stages[1](None, positions, pp_proxy_tensors=proxies)
        torch.testing.assert_close(logits, model(ids[None]).logits[0], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, n=n: f"{family}, {n} tokens: {m}")
    runtimes = _cuda_runtimes(old)
    assert runtimes and all(isinstance(state.executor, CudaGraphExecutor)
                            for rt in runtimes for state in rt.instances())
    assert all(state.captured_buckets == tuple(SIZES[:3]) for rt in runtimes for state in rt.instances())
    assert strict_cuda.flushes == sum(len(rt.instances()) for rt in runtimes)


@pytest.mark.parametrize(("family", "stamped"), [("llama", 3), ("qwen3_moe", 3), ("qwen3_next", 2)])
def test_stamped_hf_stages_capture_and_match_eager_at_every_bucket(strict_cuda: StrictCuda, family: str,
                                                                   stamped: int) -> None:
    """Dense, MoE and hybrid HF stages with ``trace_layers_once``: token dims marked (``dynamic=True``
    traces every layer flat), every bucket captured, each count equal to eager."""
    if getattr(transformers, TINY_FAMILIES[family][0], None) is None:
        pytest.skip(f"transformers {transformers.__version__} has no {TINY_FAMILIES[family][0]}")
    stage = ppcompile.trace_layers_once(HFStage(tiny_causal_lm(family, num_hidden_layers=4).eval(), 0, 1))
    (runtime,) = run_hf_stage(stage, {"capture_sizes": SIZES[:3], **GRAPHED}, [1, 4, 5, 8, 9, 16, 17], family)
    assert runtime.compiled.record.stamped_layers == stamped
    (state,) = runtime.instances()
    assert isinstance(state.executor, CudaGraphExecutor)
    assert state.captured_buckets == tuple(SIZES[:3]) and strict_cuda.flushes == 1

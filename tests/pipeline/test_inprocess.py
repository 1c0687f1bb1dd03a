"""``InProcessPipeline``: binding stage forwards by signature, and compiled == eager."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from stage_doubles import EmbedsFirstStage
from torch import nn

import ppcompile
from ppcompile.models import REFERENCE_CONFIGS, make_batch, make_stage
from ppcompile.pipeline import InProcessPipeline, StageBinding

CFG = REFERENCE_CONFIGS["tiny"]
OPTIONS = {"capture_sizes": [4, 8, 16, 32], "graph_mode": "emulate"}  # the graph path ("auto": live on CPU)


pytestmark = pytest.mark.usefixtures("fresh_dynamo", "one_thread")


class NoProxyStage(nn.Module):
    """A whole model as one stage whose forward has no ``pp_proxy_tensors`` parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = make_stage(CFG, 0, 1)
        self.start_layer, self.end_layer = 0, CFG.num_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        return self.inner(input_ids, positions)


def test_binding_reads_signature() -> None:
    stage = make_stage(CFG, 1, 2)
    assert StageBinding.of(stage) == StageBinding(input_ids=True, pp_proxy_tensors=True, embeds_name=None)
    compiled = torch.compile(stage, backend="pp_breakable", dynamic=True)
    assert StageBinding.of(compiled) == StageBinding.of(stage)  # the wrapper's original forward
    assert StageBinding.of(NoProxyStage()) == StageBinding(True, False, None)
    embeds_stage = EmbedsFirstStage(make_stage(CFG, 0, 2))
    assert StageBinding.of(embeds_stage) == StageBinding(False, False, "inputs_embeds")

    class Kw(nn.Module):
        def forward(self, positions: torch.Tensor, input_embeds: Any = None, **kw: Any) -> None: ...

    assert StageBinding.of(Kw()) == StageBinding(False, True, "input_embeds")

    class NoPositions(nn.Module):
        def forward(self, x: torch.Tensor) -> None: ...

    with pytest.raises(TypeError, match="positions"):
        StageBinding.of(NoPositions())


@pytest.mark.parametrize("compiled", [False, True])
def test_stage_without_proxy_param(compiled: bool) -> None:
    eager = InProcessPipeline(CFG, 1, compiled=False)
    pipe = InProcessPipeline(CFG, 1, compiled=compiled, options=OPTIONS, stages=[NoProxyStage()])
    for lens in ([5, 11], [32], [40]):
        ids, pos, _ = make_batch(CFG, lens, 0, 1)
        with torch.inference_mode():
            torch.testing.assert_close(pipe(ids, pos, lens), eager(ids, pos, lens), atol=1e-5, rtol=0)
    with pytest.raises(TypeError, match="no pp_proxy_tensors"):
        pipe.run_stage(0, pos, [40], input_ids=ids, pp_proxy_tensors={"hidden_states": pos})


@pytest.mark.parametrize("compiled", [False, True])
def test_first_stage_takes_inputs_embeds(compiled: bool) -> None:
    ref = InProcessPipeline(CFG, 2, compiled=False)
    stages = [EmbedsFirstStage(make_stage(CFG, 0, 2)), make_stage(CFG, 1, 2)]
    pipe = InProcessPipeline(CFG, 2, compiled=compiled, options=OPTIONS, stages=stages)
    embed = make_stage(CFG, 0, 2).embed_tokens
    assert embed is not None
    for lens in ([3, 5], [16], [9, 9, 9]):
        ids, pos, _ = make_batch(CFG, lens, 0, 2)
        with torch.inference_mode():
            want = ref(ids, pos, lens).clone()
            got = pipe(None, pos, lens, inputs_embeds=embed(ids))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    with pytest.raises(TypeError, match="inputs_embeds"):
        ref.run_stage(0, pos, lens, input_ids=ids, inputs_embeds=embed(ids))


@pytest.mark.parametrize("pp_size", [2, 4])
def test_compiled_pipeline_matches_eager(pp_size: int) -> None:
    eager = InProcessPipeline(CFG, pp_size, compiled=False)
    graphed = InProcessPipeline(CFG, pp_size, compiled=True, options=OPTIONS)
    for lens in ([1], [4], [2, 3, 4], [16], [17], [20, 12], [33], [4]):
        ids, pos, _ = make_batch(CFG, lens, 0, pp_size, seed=len(lens))
        with torch.inference_mode():
            want = eager(ids, pos, lens)
            got = graphed(ids, pos, lens)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        served = sum(lens) > 1 and sum(lens) <= 32
        assert [t.path for t in graphed.traces if t] == ["graph" if served else "eager"] * pp_size
        assert all(t.path == "module" for t in eager.traces if t)
    assert ppcompile.counters.replays > 0


def test_forward_checks_seq_lens() -> None:
    pipe = InProcessPipeline(CFG, 2, compiled=False)
    ids, pos, _ = make_batch(CFG, [4, 4], 0, 2)
    with pytest.raises(ValueError, match="sum to 9"):
        pipe(ids, pos, [4, 5])
    with pytest.raises(ValueError, match="3 stages"):
        InProcessPipeline(CFG, 2, compiled=False, stages=[make_stage(CFG, r, 3) for r in range(3)])

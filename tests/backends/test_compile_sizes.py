"""``compile_sizes`` (static-shape artifacts for chosen buckets), its validation, and float module
attributes (a norm's ``eps``) under Inductor segments: kept as tensor inputs where they feed arithmetic,
otherwise specialised by Dynamo and guarded."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from stage_helpers import check, graphed_runtime

import ppcompile
from ppcompile.backends.segment_compilers import SizeDispatch
from ppcompile.config import PPBreakableConfig
from ppcompile.models import REFERENCE_CONFIGS, make_stage

PP = 4
CFG = REFERENCE_CONFIGS["tiny"]  # one layer a stage: 2 graph segments, both distinct
SIZES = [4, 8, 16, 32, 64]
OPTIONS = {"segment_compiler": "inductor", "capture_sizes": SIZES, "graph_mode": "emulate"}  # graph path


def test_compile_sizes_serve_their_bucket_with_a_static_artifact(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[SizeDispatch, int, tuple[Any, ...]]] = []
    original = SizeDispatch.__call__

    def spy(self: SizeDispatch, *args: Any) -> Any:
        a = args[self.slot]
        calls.append((self, int(a) if self.dim < 0 else a.shape[self.dim], args))
        return original(self, *args)

    monkeypatch.setattr(SizeDispatch, "__call__", spy)
    stage = make_stage(CFG, 1, PP)
    options = {**OPTIONS, "compile_sizes": [16]}
    compiled = torch.compile(stage, backend="pp_breakable", dynamic=True, options=options)
    with ppcompile.counters.expect(segment_compiles=2, replays_by_bucket={16: 1}):
        check(stage, compiled, CFG, 1, PP, 16)
    assert [r.sizes for r in graphed_runtime().compiled.record.segment_compiles] == [(16,), (16,)]
    dispatchers = {id(d) for d, _, _ in calls}
    assert len(dispatchers) == 2 and all(16 in d.by_size for d, _, _ in calls)
    calls.clear()
    for n in (13, 17):  # bucket 16 again, then bucket 32 (the symbolic artifact)
        check(stage, compiled, CFG, 1, PP, n)
    assert sorted({n for _, n, _ in calls}) == [16, 32]
    # The bucket-16 artifact really is static: handed bucket-32 inputs, it still makes 16-row outputs
    # (segments are compiled without Inductor's input asserts, which would refuse the call).
    dispatch, _, args32 = next(c for c in calls if c[1] == 32)
    tensors = [t for t in dispatch.by_size[16](*args32) if isinstance(t, torch.Tensor) and t.dim()]
    assert tensors and {t.shape[0] for t in tensors} == {16}
    assert {t.shape[0] for t in dispatch.general(*args32) if isinstance(t, torch.Tensor) and t.dim()} == {32}


def test_compile_sizes_validation() -> None:
    config = PPBreakableConfig.from_options({**OPTIONS, "compile_sizes": [32, 16, 16]})
    assert config.compile_sizes == (16, 32)
    with pytest.raises(ValueError, match=r"compile_sizes.*\[24\] are not buckets"):
        PPBreakableConfig.from_options({**OPTIONS, "compile_sizes": [16, 24]})
    with pytest.raises(ValueError, match=r"compile_sizes.*segment_compiler is 'inductor'"):
        PPBreakableConfig.from_options({"capture_sizes": SIZES, "compile_sizes": [16]})
    ladder = PPBreakableConfig.from_options({"segment_compiler": "inductor", "compile_sizes": [1, 72]})
    assert ladder.compile_sizes == (1, 72)  # default ladder buckets
    with pytest.raises(ValueError, match="are not buckets"):
        PPBreakableConfig.from_options({"segment_compiler": "inductor", "compile_sizes": [70]})


def test_float_attributes_stay_inputs_shared_by_instances() -> None:
    """Dynamo passes a norm's ``eps`` as a 0-dim tensor input: it stays one (no re-trace), so two
    instances differing only in ``eps`` share the Dynamo graph and the compiled segments, each with
    its own value."""
    cfgs = [CFG, CFG.replace(rms_eps=1e-2)]
    stages = [make_stage(cfg, 1, PP) for cfg in cfgs]
    compiled = [torch.compile(s, backend="pp_breakable", dynamic=True, options=OPTIONS) for s in stages]
    with ppcompile.counters.expect(backend_compiles=1, segment_compiles=2):
        check(stages[0], compiled[0], cfgs[0], 1, PP, 16)
    split = graphed_runtime().split_module
    assert sum("eps" in p.name for p in split.graph.find_nodes(op="placeholder")) == 2
    assert not any(n.target == "item" for n in split.graph.find_nodes(op="call_method", target="item"))
    with ppcompile.counters.expect(backend_compiles=0, segment_compiles=0):
        check(stages[1], compiled[1], cfgs[1], 1, PP, 16)
        for cfg, stage, comp in zip(cfgs, stages, compiled):
            check(stage, comp, cfg, 1, PP, 40)


class _Clamp(torch.nn.Module):
    """A float attribute used beyond arithmetic with a tensor (``-limit`` is float arithmetic)."""

    def __init__(self, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).clamp(-self.limit, self.limit) + self.limit


def test_other_float_uses_are_specialised_by_dynamo_and_guarded() -> None:
    torch.manual_seed(0)
    modules = [_Clamp(0.25), _Clamp(0.5)]
    modules[1].load_state_dict(modules[0].state_dict())
    inputs = [torch.randn(n, 8) for n in (24, 20)]
    for m in modules:
        compiled = torch.compile(m, backend="pp_breakable", dynamic=True,
                                 options={**OPTIONS, "capture_sizes": [32]})
        with torch.inference_mode(), ppcompile.counters.expect(backend_compiles=1, replays=2):
            for x in inputs:
                torch.testing.assert_close(compiled(x), m(x), atol=1e-6, rtol=0)
        split = graphed_runtime().split_module
        assert not any("limit" in p.name for p in split.graph.find_nodes(op="placeholder"))

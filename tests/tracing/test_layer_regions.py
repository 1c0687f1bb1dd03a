"""``ppcompile.trace_layers_once``: repeated layers become nested compile regions without a change to the
model's code; results, split and buckets equal a flat trace's, per-layer constants stay out of regions,
and aliasing or in-place layers still trace."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from reference_runs import new_runtimes, run_hf_stage, run_middle_stage
from stage_checks import assert_close
from torch import nn

import ppcompile
from ppcompile.models import (
    REFERENCE_CONFIGS,
    make_stage,
)
from ppcompile.runtime.stage_runtime import StageRuntime
from ppcompile.torch_internals import region_traces_reused
from ppcompile.tracing.layer_regions import DEFAULT_MIN_REGION_MODULES

pytestmark = pytest.mark.skipif(getattr(torch.compiler, "nested_compile_region", None) is None,
                                reason="this torch has no nested_compile_region")
CAP = 16
OPTIONS = {"segment_compiler": "eager", "graph_mode": "emulate", "max_capture_tokens": CAP}
COUNTS = (1, 8, 9, 16, 23)  # 1, exactly a bucket, a bucket + 1, the cap, above the cap


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _run_reference(name: str, once: bool, min_modules: int = DEFAULT_MIN_REGION_MODULES,
                   ) -> tuple[list[Any], list[Any], StageRuntime]:
    """A middle stage of 3 layers, compiled (with or without trace_layers_once), at every count."""
    cfg = REFERENCE_CONFIGS[name].replace(num_layers=9)
    stage = make_stage(cfg, 1, 3)
    if once:
        assert ppcompile.trace_layers_once(stage, stamp=False, min_region_modules=min_modules) is stage
    return run_middle_stage(stage, cfg, OPTIONS, COUNTS)


@pytest.mark.parametrize("name", ["small-dense", "small-moe"])
def test_reference_stage_traced_once_equals_eager_with_the_flat_split(name: str) -> None:
    got, want, once = _run_reference(name, once=True, min_modules=1)  # its norms and MLP too
    for n, g, w in zip(COUNTS, got, want):
        assert_close(g, w, f"{name} at {n} tokens")
    _, _, flat = _run_reference(name, once=False)
    assert [(s.kind, s.reason, s.layer_ids) for s in once.segments] == \
        [(s.kind, s.reason, s.layer_ids) for s in flat.segments]
    assert once.plan.sizes == flat.plan.sizes
    traces = once.compiled.record.region_traces
    assert sum(traces.values()) >= 3 * 3  # norms and the MLP of 3 layers went through regions
    if region_traces_reused():
        assert len(traces) < sum(traces.values()), dict(traces)  # later layers reused a trace
    assert "nested regions:" in once.describe()


def test_the_plan_keeps_per_layer_constants_out_of_regions() -> None:
    cfg = REFERENCE_CONFIGS["small-dense"].replace(num_layers=6)
    stage = ppcompile.trace_layers_once(make_stage(cfg, 1, 2), stamp=False, min_region_modules=1)
    (plan,) = ppcompile.layer_region_plans(stage) or ()
    assert plan.layers == ("layers.3", "layers.4", "layers.5")
    assert {site.path for site in plan.regions} >= {"input_layernorm", "post_attention_layernorm", "mlp"}
    flat = dict(plan.flat)
    assert "'layer_id' differs between layers (3 in layers.3, 4 in layers.4)" in flat[""]
    assert "self_attn" in flat and "self_attn" not in {site.path for site in plan.regions}
    assert "traced flat (whole layer): 'layer_id' differs" in plan.describe()
    assert ppcompile.trace_layers_once(stage, stamp=False) is stage  # a second call does nothing
    assert ppcompile.layer_region_plans(stage) == (plan,)


def test_modules_repeated_inside_a_region_are_left_to_it(caplog: pytest.LogCaptureFixture) -> None:
    cfg = REFERENCE_CONFIGS["small-moe"].replace(num_layers=9)
    with caplog.at_level(logging.INFO, logger="ppcompile.tracing.layer_regions"):
        stage = ppcompile.trace_layers_once(make_stage(cfg, 1, 3), stamp=False)
    plans = ppcompile.layer_region_plans(stage) or ()
    assert [plan.layers for plan in plans] == [("layers.3", "layers.4", "layers.5")]  # none for experts
    assert "mlp" in {site.path for site in plans[0].regions}
    experts = [e for i in (3, 4, 5) for e in stage.layers[i].mlp.experts]
    assert experts and all("forward" not in vars(e) for e in experts)
    assert "3 group(s) of repeated MLP modules lie inside regions" in caplog.text
    _, _, runtime = _run_reference("small-moe", once=True)
    traces = runtime.compiled.record.region_traces
    assert max(traces.values()) == 3, dict(traces)  # one call per layer: no expert went through a region
    if region_traces_reused():
        assert len(traces) == len(plans[0].regions), dict(traces)  # each site traced once, MoE included


def test_modules_too_small_to_pay_for_a_region_are_traced_flat() -> None:
    """A region call costs Dynamo about what tracing a few small modules does: the reference decoder's
    norms (1 module with parameters) and MLP (2) stay flat, its MoE block (router and experts) is one."""
    dense = make_stage(REFERENCE_CONFIGS["small-dense"].replace(num_layers=6), 1, 2)
    ppcompile.trace_layers_once(dense, stamp=False)
    (plan,) = ppcompile.layer_region_plans(dense) or ()
    assert plan.regions == ()
    flat = dict(plan.flat)
    assert flat["input_layernorm"] == "too small to pay for a region (1 module(s) with parameters, " \
        "min_region_modules=4)"
    assert flat["mlp"].startswith("too small to pay for a region (2 module(s)")
    assert "traced flat mlp: too small" in plan.describe()
    assert "forward" not in vars(dense.layers[3].mlp)
    moe = make_stage(REFERENCE_CONFIGS["small-moe"].replace(num_layers=6), 1, 2)
    ppcompile.trace_layers_once(moe, stamp=False)
    (plan,) = ppcompile.layer_region_plans(moe) or ()
    assert [site.path for site in plan.regions] == ["mlp"]
    assert "forward" in vars(moe.layers[3].mlp)


class _Scale(nn.Module):
    """Returns its input as one output and a view of its result as another, and writes ``acc`` in place:
    what a region may not do without ppcompile's copies."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(h, h) / h)

    def forward(self, x: torch.Tensor, acc: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor],
                *, gain: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = (x @ self.w) * gain + pair[0] - pair[1]
        acc.add_(y)
        return x, y, y[:, : y.shape[1] // 2]


class _Layer(nn.Module):
    def __init__(self, h: int, index: int) -> None:
        super().__init__()
        self.index = index  # differs per layer: the layer itself stays flat, its child is the region
        self.scale = _Scale(h)

    def forward(self, x: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        halves = x.chunk(2, dim=1)  # two views of one tensor, passed to the region together
        same, y, half = self.scale(x, acc, (halves[0].repeat(1, 2), halves[1].repeat(1, 2)), gain=0.5)
        return same + y + half.repeat(1, 2)


class _Stack(nn.Module):
    def __init__(self, n: int = 4, h: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_Layer(h, i) for i in range(n))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        acc = torch.zeros_like(x)
        for layer in self.layers:
            x = layer(x, acc)
        return x, acc


def test_aliasing_and_in_place_regions_trace_and_equal_eager() -> None:
    stack, untouched = _Stack(), _Stack()
    ppcompile.trace_layers_once(stack, stamp=False, min_region_modules=1)
    x = torch.randn(3, 8)
    for g, w in zip(stack(x), untouched(x)):  # eagerly, the wrapped modules behave as before
        torch.testing.assert_close(g, w, atol=0, rtol=0)
    (plan,) = ppcompile.layer_region_plans(stack) or ()
    assert [site.path for site in plan.regions] == ["scale"]
    before = ppcompile.stage_runtimes()
    compiled = torch.compile(stack, backend="pp_breakable", options=OPTIONS)
    for n in COUNTS:
        x = torch.randn(n, 8, generator=torch.Generator().manual_seed(n))
        if n == COUNTS[0]:
            ppcompile.mark_token_dynamic(x)
        with torch.inference_mode():
            got, want = compiled(x.clone()), untouched(x.clone())
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    (runtime,) = new_runtimes(before)
    assert sum(runtime.compiled.record.region_traces.values()) == 4
    split = runtime.compiled.record.split_module
    assert split is not None and "region_copy" not in split.print_readable(print_output=False)


class _Unrepeated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_a_stage_without_repeated_layers_is_left_flat(caplog: pytest.LogCaptureFixture) -> None:
    module = _Unrepeated()
    with caplog.at_level(logging.INFO, logger="ppcompile.tracing.layer_regions"):
        assert ppcompile.trace_layers_once(module) is module
    assert ppcompile.layer_region_plans(module) == ()
    assert "has no repeated layers" in caplog.text
    assert "forward" not in vars(module.a)
    assert ppcompile.layer_region_plans(_Unrepeated()) is None  # not applied


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match=r"trace_layers_once: expected an nn\.Module, got function"):
        ppcompile.trace_layers_once(lambda x: x)  # type: ignore[arg-type]
    for bad in (0, -1, 2.0, True):
        stack = _Stack()
        with pytest.raises(ValueError, match=f"min_region_modules must be an int >= 1, got {bad!r}"):
            ppcompile.trace_layers_once(stack, stamp=False,
                                        min_region_modules=bad)  # type: ignore[arg-type]
        assert ppcompile.layer_region_plans(stack) is None  # refused before anything changed


class _DictLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"x": state["x"] @ self.w}


class _DictStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.layers = nn.ModuleList(_DictLayer() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = {"x": x}
        for layer in self.layers:
            state = layer(state)
        return state["x"]


def test_arguments_it_does_not_flatten_are_traced_flat_and_still_equal_eager() -> None:
    stack = ppcompile.trace_layers_once(_DictStack(), stamp=False, min_region_modules=1)
    compiled = torch.compile(stack, backend="pp_breakable", options=OPTIONS)
    x = torch.randn(5, 4)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), stack(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "qwen3_next"])
def test_hf_stages_traced_once_equal_eager(family: str) -> None:
    """Dense, MoE and hybrid HF stages, with no change to their code."""
    pytest.importorskip("transformers")
    from ppcompile.models.hf import HFStage, tiny_causal_lm

    stage = HFStage(tiny_causal_lm(family, num_hidden_layers=4).eval(), 0, 1)
    ppcompile.trace_layers_once(stage, stamp=False, min_region_modules=1)  # their norms and MLPs too
    (plan,) = ppcompile.layer_region_plans(stage) or ()
    assert plan.regions, plan.describe()
    traces = [rt.compiled.record.region_traces for rt in run_hf_stage(stage, OPTIONS, COUNTS, family)]
    assert traces and all(sum(t.values()) >= 4 for t in traces)
    if region_traces_reused():
        assert all(len(t) < sum(t.values()) for t in traces), traces


def test_an_hf_llama_layer_holds_no_part_big_enough_for_a_region() -> None:
    pytest.importorskip("transformers")
    from ppcompile.models.hf import HFStage, tiny_causal_lm

    stage = ppcompile.trace_layers_once(HFStage(tiny_causal_lm("llama", num_hidden_layers=4).eval(), 0, 1),
                                        stamp=False)
    (plan,) = ppcompile.layer_region_plans(stage) or ()
    assert plan.regions == ()
    flat = dict(plan.flat)
    assert "'self_attn.layer_idx' differs between layers" in flat[""]
    assert flat["mlp"].startswith("too small to pay for a region (3 module(s)")


def test_dynamic_true_traces_flat_instead_of_failing_inside_regions() -> None:
    stack, untouched = ppcompile.trace_layers_once(_Stack(), stamp=False, min_region_modules=1), _Stack()
    before = ppcompile.stage_runtimes()
    compiled = torch.compile(stack, backend="pp_breakable", dynamic=True, options=OPTIONS)
    for n in (3, 9):
        x = torch.randn(n, 8)
        with torch.inference_mode():
            for g, w in zip(compiled(x.clone()), untouched(x.clone())):
                torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    assert all(not rt.compiled.record.region_traces for rt in new_runtimes(before))

"""``ppcompile.trace_layers_once(stage, stamp=True)``: Dynamo traces one layer of each group and every
other layer reaches the graph as one op; the backend copies the exemplar's ops back per layer with the
layer's own weights and per-layer constants. Results, split and buckets equal a flat trace's; a layer
its check refuses is traced flat, with the reason logged."""

from __future__ import annotations

import copy
import io
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from reference_runs import new_runtimes, run_hf_stage, run_middle_stage
from stage_checks import assert_close
from torch import nn

import ppcompile
from ppcompile.backends import warm_start
from ppcompile.models import (
    REFERENCE_CONFIGS,
    make_batch,
    make_forward_context,
    make_stage,
    set_forward_context,
)
from ppcompile.runtime.stage_runtime import StageRuntime

CAP = 16
OPTIONS = {"segment_compiler": "eager", "graph_mode": "emulate", "max_capture_tokens": CAP}
COUNTS = (1, 8, 9, 16, 23)  # 1, exactly a bucket, a bucket + 1, the cap, above the cap
STAMP_LOG = "ppcompile.tracing.layer_stamps"


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _run_reference(name: str, stamp: bool, layers: int = 3) -> tuple[list[Any], list[Any], StageRuntime]:
    """A middle stage of ``layers`` layers, compiled (stamped or flat), at every count."""
    cfg = REFERENCE_CONFIGS[name].replace(num_layers=3 * layers)
    stage = make_stage(cfg, 1, 3)
    if stamp:
        assert ppcompile.trace_layers_once(stage, stamp=True) is stage
    return run_middle_stage(stage, cfg, OPTIONS, COUNTS)


def _split(runtime: StageRuntime) -> list[Any]:
    """Each segment's kind, break reason (not its stack trace) and global layer ids."""
    return [(s.kind, s.reason and (s.reason.kind, s.reason.op, s.reason.detail), s.layer_ids)
            for s in runtime.segments]


@pytest.mark.parametrize("name", ["small-dense", "small-moe", "hidden-only"])
def test_reference_stage_stamped_equals_eager_with_the_flat_split(name: str) -> None:
    got, want, stamped = _run_reference(name, stamp=True)
    for n, g, w in zip(COUNTS, got, want):
        assert_close(g, w, f"{name} at {n} tokens")
    _, _, flat = _run_reference(name, stamp=False)
    assert stamped.compiled.record.stamped_layers == 2  # the first layer traced, the other two stamped
    assert _split(stamped) == _split(flat)  # global layer ids substituted per layer
    assert stamped.plan.sizes == flat.plan.sizes
    split = stamped.compiled.record.split_module
    assert split is not None
    text = split.print_readable(print_output=False)
    for op in ("stamped_layer", "layer_input", "layer_output"):
        assert f"ppcompile.{op}" not in text, op
    assert "bound_layers_5_" in text  # layer 5's own weights, graph inputs
    assert "stamped layers: 2" in stamped.describe()


def test_each_stamped_layer_reads_its_own_weights() -> None:
    """Stamped layers' weights are graph inputs bound to the live parameters: an in-place weight update
    shows in the next call, as it does in eager mode."""
    cfg = REFERENCE_CONFIGS["small-dense"].replace(num_layers=9)
    stage = ppcompile.trace_layers_once(make_stage(cfg, 1, 3), stamp=True)
    compiled = torch.compile(stage, backend="pp_breakable", options=OPTIONS)
    _, pos, proxies = make_batch(cfg, [5], 1, 3)
    ppcompile.mark_token_dynamic(pos, proxies)

    def both() -> tuple[Any, Any]:
        ctx = make_forward_context([5], cfg, range(stage.start_layer, stage.end_layer))
        with torch.inference_mode(), set_forward_context(ctx):
            return {k: v.clone() for k, v in compiled(None, pos, pp_proxy_tensors=proxies).items()}, \
                dict(stage(None, pos, pp_proxy_tensors=proxies).items())

    assert_close(*both(), "before the update")
    with torch.no_grad():
        stage.layers[stage.end_layer - 1].mlp.down_proj.weight.mul_(-2.0)  # a stamped layer's weight
    got, want = both()
    assert_close(got, want, "after updating a stamped layer's weight in place")


class _Gate(nn.Module):
    """Doubles its input in layers whose index is odd: a branch on a per-layer attribute, which an
    exemplar's trace cannot stand for."""

    def __init__(self, h: int, index: int) -> None:
        super().__init__()
        self.index = index
        self.w = nn.Parameter(torch.randn(h, h) / h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.w
        return y * 2 if self.index % 2 else y


class _Scaled(_Gate):
    """Multiplies by a per-layer Python number: a constant a torch op takes, which is not substituted."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w) * (self.index + 1.0)


class _Stack(nn.Module):
    def __init__(self, layer: type[nn.Module], n: int = 4, h: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(layer(h, i) for i in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _compile_and_compare(stack: nn.Module, untouched: nn.Module, backend: str = "pp_breakable") -> None:
    """``stack`` compiled against ``untouched`` eager at every count: outputs, and inputs after the call
    (a layer may write its input)."""
    options = OPTIONS if backend == "pp_breakable" else None
    compiled = torch.compile(stack, backend=backend, options=options)
    for n in COUNTS:
        x = torch.randn(n, 8, generator=torch.Generator().manual_seed(n))
        if n == COUNTS[0]:
            ppcompile.mark_token_dynamic(x)
        got_x, want_x = x.clone(), x.clone()
        with torch.inference_mode():
            torch.testing.assert_close(compiled(got_x), untouched(want_x), atol=1e-5, rtol=0)
        torch.testing.assert_close(got_x, want_x, atol=0, rtol=0)


@pytest.mark.parametrize(("layer", "why"), [
    (_Gate, "it runs 2 ops, layers.0 1"),
    (_Scaled, "its call of aten::mul.Tensor differs from layers.0's in argument 1 (2.0 vs 1.0)"),
])
def test_a_layer_its_check_refuses_is_traced_flat_and_logged(
    layer: type[nn.Module], why: str, caplog: pytest.LogCaptureFixture
) -> None:
    stack = ppcompile.trace_layers_once(_Stack(layer), stamp=True)
    before = ppcompile.stage_runtimes()
    with caplog.at_level(logging.INFO, logger=STAMP_LOG):
        _compile_and_compare(stack, _Stack(layer))
    assert f"trace_layers_once: layers.1 is traced flat: {why}" in caplog.text
    (runtime,) = new_runtimes(before)
    assert runtime.compiled.record.stamped_layers < 3
    assert runtime.compiled.record.traced_flat["layers.1"] == why
    assert f"traced flat, not stamped: layers.1: {why}" in runtime.describe()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_other_backends_give_eager_results_when_a_check_refuses(backend: str) -> None:
    """A refused layer's stamped op stays in Dynamo's graph with no users, then the layer is traced
    flat: the results are the layer's own."""
    stack = ppcompile.trace_layers_once(_Stack(_Gate), stamp=True)
    _compile_and_compare(stack, _Stack(_Gate), backend)


class _Writer(_Gate):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(0.5)  # writes its input: stamped, its op would write a copy under other backends
        return x @ self.w


@pytest.mark.parametrize("backend", ["pp_breakable", "aot_eager"])
def test_layers_that_write_their_input_are_traced_flat(backend: str,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """The exemplar writes its input back (other backends run its input marker as a copy); a stamped
    layer could not, so none is stamped."""
    stack = ppcompile.trace_layers_once(_Stack(_Writer), stamp=True)
    with caplog.at_level(logging.INFO, logger=STAMP_LOG):
        _compile_and_compare(stack, _Stack(_Writer), backend)  # the first layer's write is kept too
    assert "layers.1 is traced flat: layers.0 writes its input 0 in place" in caplog.text


class _Plain(nn.Module):
    def __init__(self, h: int, index: int) -> None:
        super().__init__()
        self.index = index
        self.w = nn.Parameter(torch.randn(h, h) / h)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None, *,
                gain: float = 1.0) -> torch.Tensor:
        y = x @ self.w * gain
        return y if bias is None else y + bias


class _PlainStack(_Stack):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x, None, gain=0.5))
        return x


class _Pair(_Gate):
    """Returns its output in a container: a tuple or a list, with or without a None in it."""

    shape = ("tuple", False)

    def forward(self, x: torch.Tensor) -> Any:
        kind, with_none = self.shape
        out = [x @ self.w, x * 0.5] if not with_none else [x @ self.w, None]
        return tuple(out) if kind == "tuple" else out


class _PairStack(_Stack):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            out = layer(x)
            if type(out).__name__ != _Pair.shape[0]:  # a stamped layer gives back the container it made
                raise TypeError(f"{type(out).__name__} returned")
            first, second = out
            x = torch.tanh(first) if second is None else torch.tanh(first + second)
        return x


@pytest.mark.parametrize("shape", [("tuple", False), ("list", False), ("tuple", True), ("list", True)])
def test_a_layer_returning_a_tuple_or_a_list_is_stamped(shape: tuple[str, bool],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_Pair, "shape", shape)
    stack = ppcompile.trace_layers_once(_PairStack(_Pair), stamp=True)
    before = ppcompile.stage_runtimes()
    _compile_and_compare(stack, _PairStack(_Pair))
    assert [rt.compiled.record.stamped_layers for rt in new_runtimes(before)] == [3]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_other_backends_run_stamped_layers_as_their_own_forward(backend: str) -> None:
    """Without ppcompile's backend the stamped op runs the layer's code: the same results."""
    stack = ppcompile.trace_layers_once(_PlainStack(_Plain), stamp=True)
    x = torch.randn(3, 8)
    torch.testing.assert_close(stack(x), _PlainStack(_Plain)(x), atol=0, rtol=0)  # eagerly: as before
    _compile_and_compare(stack, _PlainStack(_Plain), backend)


def test_stamped_layers_take_the_stamping_forward_from_their_class() -> None:
    """Dynamo calls a module's ``forward`` straight only where the instance has none of its own; with an
    instance ``forward`` it traces ``nn.Module.__call__`` and its hook checks for every layer. Stamping
    gives each layer a subclass of its own class instead, and leaves that class as it was."""
    own = _Plain.forward
    stack = ppcompile.trace_layers_once(_PlainStack(_Plain), stamp=True)
    assert len({type(layer) for layer in stack.layers}) == 1
    for layer in stack.layers:
        assert "forward" not in vars(layer)
        assert isinstance(layer, _Plain) and type(layer).__name__ == "Stamped_Plain"
    assert _Plain.forward is own and type(_Plain(8, 0)) is _Plain
    x = torch.randn(3, 8)
    torch.testing.assert_close(stack(x), _PlainStack(_Plain)(x), atol=0, rtol=0)


def test_the_list_holding_stamped_layers_indexes_as_a_module_list_does() -> None:
    """Its class is a subclass with an indexing Dynamo traces in fewer steps (an engine's
    ``self.layers[i]``); what indexing returns and raises is a ``ModuleList``'s."""
    stack = ppcompile.trace_layers_once(_PlainStack(_Plain), stamp=True)
    layers, in_order = stack.layers, list(stack.layers)
    assert isinstance(layers, nn.ModuleList) and type(layers).__name__ == "StampedModuleList"
    for index in (0, 3, -1, -4, True):
        assert layers[index] is in_order[index]
    assert list(layers[1:3]) == in_order[1:3]
    for index in (4, -5):
        with pytest.raises(IndexError, match=f"index {index} is out of range"):
            layers[index]
    with pytest.raises(TypeError):
        layers["0"]


def test_a_module_holding_a_stamped_stage_can_be_stamped_again() -> None:
    """The layers keep one stamped class, and the outer module's trace stamps them out."""
    inner = ppcompile.trace_layers_once(_PlainStack(_Plain), stamp=True)
    stamped_class = type(inner.layers[0])
    outer = ppcompile.trace_layers_once(nn.Sequential(inner), stamp=True)
    assert all(type(layer) is stamped_class for layer in inner.layers)
    before = ppcompile.stage_runtimes()
    _compile_and_compare(outer, nn.Sequential(_PlainStack(_Plain)))
    assert [rt.compiled.record.stamped_layers for rt in new_runtimes(before)] == [3]


class _Sealed(_Plain):
    """A layer class that refuses subclasses (a framework's class registry, say)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        raise TypeError(f"{cls.__name__}: _Sealed takes no subclasses")


def test_a_layer_class_that_refuses_subclasses_is_traced_flat() -> None:
    stack = ppcompile.trace_layers_once(_PlainStack(_Sealed), stamp=True)
    (plan,) = ppcompile.layer_region_plans(stack) or ()
    assert not plan.stamped
    assert ("traced flat (whole layer): its class cannot be subclassed (TypeError: Stamped_Sealed: _Sealed "
            "takes no subclasses)") in plan.describe()
    assert all(type(layer) is _Sealed and "forward" not in vars(layer) for layer in stack.layers)
    before = ppcompile.stage_runtimes()
    _compile_and_compare(stack, _PlainStack(_Sealed))
    assert [rt.compiled.record.stamped_layers for rt in new_runtimes(before)] == [0]


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_of_a_stamped_stage_has_plain_layers(how: str) -> None:
    """A copy is no stamped stage (``trace_layers_once`` applies to the module it was given): its layers
    are of their own class, with nothing of the original's stamps, and compile as a flat trace."""
    stack = ppcompile.trace_layers_once(_PlainStack(_Plain), stamp=True)
    if how == "deepcopy":
        copied = copy.deepcopy(stack)
    else:
        buffer = io.BytesIO()
        torch.save(stack, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    plain = _Plain(8, 0)
    assert type(copied.layers) is nn.ModuleList
    for layer in copied.layers:
        assert type(layer) is _Plain and set(vars(layer)) == set(vars(plain))
    assert all(type(layer) is not _Plain for layer in stack.layers)  # the original stays stamped
    before = ppcompile.stage_runtimes()
    _compile_and_compare(copied, _PlainStack(_Plain))
    assert [rt.compiled.record.stamped_layers for rt in new_runtimes(before)] == [0]


def test_plan_says_the_group_is_stamped() -> None:
    stack = ppcompile.trace_layers_once(_PlainStack(_Plain))  # stamping is the default
    (plan,) = ppcompile.layer_region_plans(stack) or ()
    assert plan.stamped and plan.regions == () and len(plan.layers) == 4
    assert "stamped: the first layer called is traced" in plan.describe()


def test_stamp_must_be_a_bool() -> None:
    stack = _PlainStack(_Plain)
    with pytest.raises(TypeError, match="trace_layers_once: stamp must be True or False, got 1"):
        ppcompile.trace_layers_once(stack, stamp=1)  # type: ignore[arg-type]
    assert ppcompile.layer_region_plans(stack) is None


def test_dynamic_true_traces_stamped_layers_flat() -> None:
    stack = ppcompile.trace_layers_once(_PlainStack(_Plain), stamp=True)
    before = ppcompile.stage_runtimes()
    compiled = torch.compile(stack, backend="pp_breakable", dynamic=True, options=OPTIONS)
    for n in (3, 9):
        x = torch.randn(n, 8)
        with torch.inference_mode():
            torch.testing.assert_close(compiled(x), _PlainStack(_Plain)(x), atol=1e-5, rtol=0)
    assert all(rt.compiled.record.stamped_layers == 0 for rt in new_runtimes(before))


@pytest.mark.parametrize(("family", "stamped"), [("llama", 3), ("qwen3_moe", 3), ("qwen3_next", 2)])
def test_hf_stages_stamped_equal_eager(family: str, stamped: int) -> None:
    """Dense, MoE and hybrid HF stages, with no change to their code. The hybrid's layers take other
    arguments in its attention layers than in its linear-attention ones: one exemplar for each."""
    pytest.importorskip("transformers")
    from ppcompile.models.hf import HFStage, tiny_causal_lm

    stage = HFStage(tiny_causal_lm(family, num_hidden_layers=4).eval(), 0, 1)
    ppcompile.trace_layers_once(stage, stamp=True)
    runtimes = run_hf_stage(stage, OPTIONS, COUNTS, family)
    assert [rt.compiled.record.stamped_layers for rt in runtimes] == [stamped]


def test_warm_compile_of_a_stamped_stage_compiles_as_torch_compile_does(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It falls back before Dynamo's ahead-of-time trace, which would run and then fail."""
    monkeypatch.setenv("PPCOMPILE_CACHE_DIR", str(tmp_path))

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("warm_compile traced a stamped stage ahead of time")

    monkeypatch.setattr(warm_start, "aot_compile", refuse)
    cfg = REFERENCE_CONFIGS["small-dense"].replace(num_layers=9)
    stage = ppcompile.trace_layers_once(make_stage(cfg, 1, 3), stamp=True)
    compiled = ppcompile.warm_compile(stage, OPTIONS)
    _, pos, proxies = make_batch(cfg, [5], 1, 3)
    ppcompile.mark_token_dynamic(pos, proxies)
    ctx = make_forward_context([5], cfg, range(stage.start_layer, stage.end_layer))
    with torch.inference_mode(), set_forward_context(ctx):
        got = {k: v.clone() for k, v in compiled(None, pos, pp_proxy_tensors=proxies).items()}
        assert_close(got, dict(stage(None, pos, pp_proxy_tensors=proxies).items()), "warm_compile")
    assert compiled.fallback_reason == (
        f"its layer layers.{stage.start_layer} is stamped by trace_layers_once, and a stamped layer compiles "
        "only inside the Dynamo trace that stamps it, not from a stored one")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_stamped_stage_on_cuda_graphs_equals_eager() -> None:
    """Real CUDA graphs replay the stamped layers' copies with their bound weights."""
    cfg = REFERENCE_CONFIGS["small-dense"].replace(num_layers=12)
    stage = ppcompile.trace_layers_once(make_stage(cfg, 1, 3, device="cuda"), stamp=True)
    before = ppcompile.stage_runtimes()
    compiled = torch.compile(stage, backend="pp_breakable", options={"max_capture_tokens": CAP})
    for n in COUNTS:
        _, pos, proxies = make_batch(cfg, [n], 1, 3, seed=n, device="cuda")
        if n == COUNTS[0]:
            ppcompile.mark_token_dynamic(pos, proxies)
        layers = range(stage.start_layer, stage.end_layer)
        with torch.inference_mode():
            with set_forward_context(make_forward_context([n], cfg, layers, device="cuda")):
                got = {k: v.clone() for k, v in compiled(None, pos, pp_proxy_tensors=proxies).items()}
            with set_forward_context(make_forward_context([n], cfg, layers, device="cuda")):
                want = dict(stage(None, pos, pp_proxy_tensors=proxies).items())
        assert_close(got, want, f"cuda at {n} tokens", 1e-4)
    (runtime,) = new_runtimes(before)
    assert runtime.compiled.record.stamped_layers == 3 and runtime.graph_mode == "cuda"

"""stored_kernels: inside warm_compile an Inductor compile keeps the artifacts it loads from in another
process; outside, or with Inductor's caches off, it is the compiled function itself."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ppcompile.backends.stored_kernels import StoredKernel, load_kernel, storable_compile, storing_kernels
from ppcompile.torch_internals import inductor_compile, tracing_context


def _one_output(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x * 2)


def _two_outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x + 1, torch.tanh(x)


def _recorded_once(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) - 3


def _graph_of(fn: Callable[..., Any]) -> torch.fx.GraphModule:
    """``fn`` as aten ops (a graph of op calls only, as Dynamo's segments are)."""
    aten = torch.ops.aten
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    if fn is _recorded_once:
        graph.output(graph.call_function(aten.sub.Tensor, (graph.call_function(aten.sin.default, (x,)), 3)))
    elif fn is _one_output:
        graph.output(graph.call_function(aten.relu.default, (graph.call_function(aten.mul.Tensor, (x, 2)),)))
    else:
        added = graph.call_function(aten.add.Tensor, (x, 1))
        tanh = graph.call_function(aten.tanh.default, (x,))
        graph.output((added, tanh))
    return torch.fx.GraphModule({}, graph)


def _compiling(fn: Callable[..., Any]) -> tuple[torch.fx.GraphModule, Callable[[], Any]]:
    """``fn``'s graph, and its Inductor compile over fake inputs with a shape env (as in a Dynamo trace:
    AOTAutograd's cache, which records the artifacts, needs one)."""
    gm = _graph_of(fn)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        fake = torch.empty(4, 3)

    def compile() -> Any:
        with tracing_context(mode):
            return inductor_compile(gm, [fake])

    return gm, compile


def test_outside_warm_compile_the_compiled_function_is_returned_as_is() -> None:
    assert not isinstance(storable_compile(*_compiling(_one_output)), StoredKernel)


@pytest.mark.parametrize("fn", [_one_output, _two_outputs])
def test_a_stored_kernel_loads_from_its_artifacts_and_returns_what_the_compile_did(
        fn: Callable[..., Any]) -> None:
    with storing_kernels():
        kernel = storable_compile(*_compiling(fn))
    assert isinstance(kernel, StoredKernel) and kernel.artifacts and kernel.key
    assert kernel.single_output == (fn is _one_output)
    loaded = load_kernel(*pickle.loads(pickle.dumps((kernel.artifacts, kernel.key, kernel.single_output))))
    assert loaded.fn is not kernel.fn
    x = torch.randn(4, 3)
    want, got = fn(x), loaded(x)
    if fn is _one_output:
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(kernel(x), want)
    else:
        assert len(got) == 2
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)


def test_with_inductors_caches_off_nothing_is_recorded() -> None:
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False), \
            storing_kernels():
        fn = storable_compile(*_compiling(_one_output))
    assert not isinstance(fn, StoredKernel)


def test_a_callers_own_recording_holds_the_stored_kernels_artifacts() -> None:
    """Torch's mega-cache (``save_cache_artifacts``) a serving engine ships to other machines: the
    kernels compiled while storing are in it, as after a plain compile (no other test compiles this
    graph, so only this compile can have put its key there)."""
    with storing_kernels():
        kernel = storable_compile(*_compiling(_recorded_once))
    assert isinstance(kernel, StoredKernel)
    saved = torch.compiler.save_cache_artifacts()
    assert saved is not None
    assert kernel.key in list(saved[1].aot_autograd_artifacts)
    x = torch.randn(4, 3)
    torch.testing.assert_close(kernel(x), _recorded_once(x))

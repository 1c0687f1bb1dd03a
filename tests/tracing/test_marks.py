"""``mark_token_dynamic``: a symbolic token count without ``dynamic=True``'s per-call float inputs."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch
from runtime_helpers import symbolic_runtime

import ppcompile
from ppcompile.models import (
    REFERENCE_CONFIGS,
    make_batch,
    make_forward_context,
    make_stage,
    set_forward_context,
)

PP = 4
CFG = REFERENCE_CONFIGS["small-dense"].replace(num_layers=8)
SIZES = [4, 8, 16, 32, 64]
OPTIONS = {"capture_sizes": SIZES, "graph_mode": "emulate"}  # the graph path ("auto" is live-size on CPU)


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _dynamic_dims(t: torch.Tensor) -> set[int]:
    return set(getattr(t, "_dynamo_dynamic_indices", set()))


def test_marks_the_token_dim_of_every_tensor_it_finds() -> None:
    ids, pos = torch.zeros(5, dtype=torch.long), torch.arange(5)
    proxies = ppcompile.PPProxyTensors({"hidden_states": torch.zeros(5, 8), "residual": torch.zeros(5, 8)})
    nested = {"topk": [torch.zeros(5, 2, dtype=torch.int32)], "scale": torch.tensor(1.0)}
    assert ppcompile.mark_token_dynamic(ids, None, pos, proxies, nested, 3) == 5
    for t in (ids, pos, *proxies.values(), nested["topk"][0]):  # type: ignore[index]
        assert _dynamic_dims(t) == {0}
    assert _dynamic_dims(nested["scale"]) == set()  # a 0-d tensor has no token dim: skipped
    x = torch.zeros(2, 7)
    assert ppcompile.mark_token_dynamic([x], dim=1) == 1 and _dynamic_dims(x) == {1}


@pytest.mark.parametrize("dim", [-1, 1.0, True, "0"])
def test_a_bad_dim_is_a_clear_error(dim: object) -> None:
    with pytest.raises(ValueError, match="mark_token_dynamic: dim must be a non-negative int"):
        ppcompile.mark_token_dynamic(torch.zeros(3), dim=dim)  # type: ignore[arg-type]


def _run(stage: torch.nn.Module, fn: object, n: int, mark: bool) -> dict[str, torch.Tensor]:
    _, pos, proxies = make_batch(CFG, [n], 1, PP, seed=n)
    if mark:
        ppcompile.mark_token_dynamic(pos, proxies)
    layers = range(stage.start_layer, stage.end_layer)  # type: ignore[arg-type]
    with torch.inference_mode(), set_forward_context(make_forward_context([n], CFG, layers)):
        return fn(None, pos, pp_proxy_tensors=proxies)  # type: ignore[operator, no-any-return]


def test_marked_stage_graphs_from_its_first_call_and_keeps_floats_constant() -> None:
    stage = make_stage(CFG, 1, PP)
    compiled = torch.compile(stage, backend="pp_breakable", options=OPTIONS)
    n0 = CFG.hidden_size  # equal to the hidden size: no duck sizing with marked dims
    c = ppcompile.counters
    with c.expect(backend_compiles=1, replays=1):
        got, want = _run(stage, compiled, n0, True), _run(stage, stage, n0, False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    rt = symbolic_runtime(stage)
    assert rt.eager_reason is None
    assert rt.compiled.scalar_slots == ()  # the RMSNorm eps values are constants in the graph, not inputs
    # Later calls need no marking: the dynamic graph serves them (1 token is Dynamo's own static graph).
    with c.expect(backend_compiles=1, replays=2, eager_runs=2):
        for n in (1, 16, 17, 70):
            torch.testing.assert_close(_run(stage, compiled, n, False), _run(stage, stage, n, False),
                                       atol=1e-5, rtol=0)


def test_dynamic_true_passes_the_float_attributes_as_inputs() -> None:
    """What the marking avoids: ``dynamic=True`` lifts every RMSNorm eps into a per-call graph input."""
    stage = make_stage(CFG, 1, PP)
    compiled = torch.compile(stage, backend="pp_breakable", dynamic=True, options=OPTIONS)
    _run(stage, compiled, 16, False)
    assert len(symbolic_runtime(stage).compiled.scalar_slots) == 2 * (stage.end_layer - stage.start_layer)


def test_size_oblivious_tracing_graphs_one_token_forwards() -> None:
    """The recipe the user guide gives for 1-token forwards: Dynamo's size-oblivious mode keeps the
    token dim symbolic at 1, so those forwards replay bucket 1 instead of running eagerly."""
    fx_config = pytest.importorskip("torch.fx.experimental._config")
    if not hasattr(fx_config, "backed_size_oblivious"):
        pytest.skip("this torch has no backed_size_oblivious")
    stage = make_stage(CFG, 1, PP)
    with fx_config.patch(backed_size_oblivious=True):
        options = {**OPTIONS, "capture_sizes": [1, *SIZES]}
        compiled = torch.compile(stage, backend="pp_breakable", options=options)
        c = ppcompile.counters
        with c.expect(replays=3, eager_runs=0, replays_by_bucket={8: 1, 1: 2}):
            for n, mark in ((5, True), (1, False), (1, False)):
                torch.testing.assert_close(_run(stage, compiled, n, mark), _run(stage, stage, n, False),
                                           atol=1e-5, rtol=0)


def test_a_batch_first_input_is_named_when_marked_and_when_the_stage_never_graphs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A ``[1, T, H]`` input reads as 1 token (dim 0): the marking warns, and the always-eager reason
    names the input and the way out instead of only blaming Dynamo."""
    lin = torch.nn.Linear(8, 8)

    def stage(x: torch.Tensor) -> torch.Tensor:
        return lin(x).relu()

    x = torch.randn(1, 6, 8)
    with caplog.at_level("WARNING", logger="ppcompile"):
        assert ppcompile.mark_token_dynamic(x) == 1
    assert "shape [1, 6, 8] has size 1 at dim 0" in caplog.text and "pass dim=1" in caplog.text
    compiled = torch.compile(stage, backend="pp_breakable", options={"graph_mode": "emulate",
                                                                     "capture_sizes": [8, 16]})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), stage(x))
    reason = ppcompile.stage_runtimes()[-1].eager_reason  # a static graph: no token symbol
    assert reason is not None and re.search(r"graph input \d+ has shape \[1, 6, 8\]: batch-first\?", reason)
    caplog.clear()
    with caplog.at_level("WARNING", logger="ppcompile"):
        ppcompile.mark_token_dynamic(torch.randn(1, 8), torch.randn(6, 1, 8))  # one token; T=6 with a 1
    assert "has size 1" not in caplog.text


class _TableStage(torch.nn.Module):
    """``x [T, 8]`` plus a row of ``table [R, 8]`` picked per token by ``index [T]``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, index: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x) + table[index])


def test_mark_first_call_graphs_a_driver_that_always_sends_one_count() -> None:
    """A driver that makes its inputs and always sends 6 tokens: marked on the first call, the stage graphs
    from that call on (unmarked, Dynamo traces 6 as a constant and the stage never graphs); the table,
    whose dim 0 is no token count, stays static."""
    torch.manual_seed(0)
    stage = _TableStage()
    wrapped = ppcompile.mark_first_call(torch.compile(stage, backend="pp_breakable", options=OPTIONS))
    table = torch.randn(11, 8)
    with torch.no_grad():
        for step in range(3):
            x, index = torch.randn(6, 8), torch.randint(0, 11, (6,))
            with ppcompile.counters.expect(replays=1, replays_by_bucket={8: 1}):
                torch.testing.assert_close(wrapped(x, index, table), stage(x, index, table), msg=str(step))
        x, index = torch.randn(3, 8), torch.randint(0, 11, (3,))
        with ppcompile.counters.expect(replays=1):
            torch.testing.assert_close(wrapped(x, index, table), stage(x, index, table))
    (runtime,) = ppcompile.stage_runtimes()
    assert runtime.token_symbol is not None and not runtime.break_reasons, runtime.describe()
    assert not _dynamic_dims(table)


def test_unmarked_the_same_driver_never_graphs() -> None:
    stage = _TableStage()
    compiled = torch.compile(stage, backend="pp_breakable", options=OPTIONS)
    table = torch.randn(11, 8)
    with torch.no_grad(), ppcompile.counters.expect(replays=0):
        for _ in range(3):
            compiled(torch.randn(6, 8), torch.randint(0, 11, (6,)), table)


def test_a_marked_stage_passes_attributes_through() -> None:
    module = torch.fx.symbolic_trace(_TableStage())
    wrapped = ppcompile.mark_first_call(torch.compile(module, backend="pp_breakable", options=OPTIONS))
    assert wrapped.graph is module.graph and wrapped.lin is module.lin
    with pytest.raises(AttributeError):
        _ = wrapped.no_such_attribute

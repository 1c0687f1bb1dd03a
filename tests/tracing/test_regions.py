"""ppcompile.opaque_module: a module instance as one custom op that Dynamo does not trace, so code that
would fix the token count (a Python loop over the tokens) compiles once for every count."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import ppcompile
from ppcompile.tracing.regions import OPAQUE_LIBRARY_MIXERS, opaque_library_mixers, opaque_module

H = 8
SIZES = [4, 8, 16]
pytestmark = pytest.mark.usefixtures("fresh_dynamo", "one_thread")


class LoopScan(nn.Module):
    """A running sum over the tokens, one Python step per token: traced, it unrolls to the count."""

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        acc = torch.zeros_like(x[0]) if state is None else state
        rows = []
        for i in range(x.shape[0]):
            acc = acc + x[i]
            rows.append(acc)
        return torch.stack(rows)


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.scan, self.down = nn.Linear(H, H), LoopScan(), nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.scan(torch.relu(self.up(x))))


def _new_runtimes(before: int) -> list[Any]:
    return ppcompile.stage_runtimes()[before:]


def test_an_opaque_module_is_one_break_and_one_stage_graph_for_every_count() -> None:
    stage = Stage()
    opaque_module(stage.scan)
    before = len(ppcompile.stage_runtimes())
    compiled = torch.compile(stage, backend="pp_breakable",
                             options={"capture_sizes": SIZES, "graph_mode": "emulate"})
    counts = [5, 4, 8, 9, 16, 3, 12, 17, 2, 1]  # a bucket, off it, above the cap (16), one token last
    with torch.no_grad():
        for n in counts:
            x = torch.randn(n, H, generator=torch.Generator().manual_seed(n))
            ppcompile.mark_token_dynamic(x)
            torch.testing.assert_close(compiled(x), stage(x), rtol=1e-5, atol=1e-5)
    symbolic = [rt for rt in _new_runtimes(before) if rt.token_symbol is not None]
    assert len(symbolic) == 1 and len(_new_runtimes(before)) <= 2  # one symbolic graph (+ one token)
    (reason,) = symbolic[0].break_reasons
    assert "opaque_module" in reason.op, symbolic[0].describe()


def test_without_opaque_the_loop_specialises_the_count() -> None:
    """The contrast: traced, the loop fixes the count, so Dynamo refuses the marked token dim."""
    stage = Stage()
    compiled = torch.compile(stage, backend="pp_breakable", options={"capture_sizes": SIZES})
    x = torch.randn(5, H)
    ppcompile.mark_token_dynamic(x)
    with torch.no_grad(), pytest.raises(Exception, match="specializ"):
        compiled(x)


def test_called_with_more_than_one_tensor_it_runs_as_before() -> None:
    scan = opaque_module(LoopScan())
    x, state = torch.randn(3, H), torch.randn(H)
    torch.testing.assert_close(scan(x, state), LoopScan.forward(scan, x, state))
    torch.testing.assert_close(scan(x, state=None), LoopScan.forward(scan, x))
    torch.testing.assert_close(scan(x=x), LoopScan.forward(scan, x))


def test_keywords_only_kwargs_would_take_are_dropped() -> None:
    """As HF's layers pass extras (position embeddings) on to mixers whose ``**kwargs`` ignore them."""

    class Mixer(LoopScan):
        def forward(self, x: torch.Tensor, state: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
            return super().forward(x, state)

    mixer = opaque_module(Mixer())
    x = torch.randn(4, H)
    before = len(ppcompile.stage_runtimes())
    compiled = torch.compile(lambda t: mixer(t, state=None, rope=(t, t)), backend="pp_breakable",
                             options={"capture_sizes": SIZES, "graph_mode": "emulate"})
    ppcompile.mark_token_dynamic(x)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), LoopScan.forward(mixer, x))
    (runtime,) = _new_runtimes(before)
    assert ["opaque_module" in r.op for r in runtime.break_reasons] == [True], runtime.describe()


def test_bad_modules_get_clear_errors() -> None:
    class Pool(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum(0)

    shape_error = r"must map a tensor to one of the same shape.*got torch.float32 \[8\]"
    with pytest.raises(TypeError, match=shape_error):
        opaque_module(Pool())(torch.randn(3, H))
    with pytest.raises(TypeError, match=r"expected an nn\.Module instance"):
        opaque_module(LoopScan)  # type: ignore[arg-type]
    scan = LoopScan()
    assert opaque_module(opaque_module(scan)) is scan
    forward = scan.forward
    opaque_module(scan)
    assert scan.forward is forward  # declaring twice wraps once


def test_opaque_library_mixers_finds_the_state_space_mixers() -> None:
    transformers = pytest.importorskip("transformers")
    from ppcompile.models.hf import tiny_causal_lm

    if getattr(transformers, "BambaConfig", None) is None:
        pytest.skip(f"transformers {transformers.__version__} has no Bamba")
    model = tiny_causal_lm("bamba", num_hidden_layers=2)
    ids = torch.arange(1, 7)[None]
    with torch.no_grad():
        want = model(ids).logits
        assert opaque_library_mixers(model) == 1  # layer 0 is Mamba-2, layer 1 attention
        mixers = [m for m in model.modules() if getattr(m.forward, "__pp_opaque__", False)]
        assert [type(m).__name__ for m in mixers] == ["BambaMixer"]
        assert all(f"{type(m).__module__}.{type(m).__qualname__}" in OPAQUE_LIBRARY_MIXERS for m in mixers)
        torch.testing.assert_close(model(ids).logits, want)

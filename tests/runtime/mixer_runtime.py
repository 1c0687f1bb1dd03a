"""The stage the ``StageRuntime`` tests share (``test_stage_runtime.py``, ``test_capture_policies.py``,
``test_graph_semantics.py``), and their helpers.

The stage is two graph segments around a user break op (``pptest_rt::mixer``), whose result depends on
every live row (a causal mean plus the mean over all rows), so a break that saw padding rows, or a graph
that read a stale buffer, gives a visibly different answer. Graphs run in the emulated executor (CPU),
which gives CUDA-graph semantics: graphs read only the tensors they captured.
"""

from __future__ import annotations

from typing import Any

import torch
from mixer_stage import MixerStage, register_mixer
from runtime_helpers import symbolic_runtime
from torch import nn

from ppcompile.runtime.instance import StageInstance
from ppcompile.runtime.stage_runtime import StageRuntime

__all__ = [
    "SIZES",
    "H",
    "HalfStage",
    "Stage",
    "check",
    "compile_stage",
    "graph_steps",
    "inputs",
    "only_state",
    "seen_rows",
    "symbolic_runtime",
]

H = 8
SIZES = [4, 8, 16]
seen_rows: list[int] = []  # the row counts the mixer saw, call by call (tests clear it)


mixer = register_mixer("pptest_rt::mixer", lambda x: seen_rows.append(x.shape[0]))


def _mixer_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    pass


def _mixer_backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    n = grad.shape[0]
    count = torch.arange(1, n + 1, dtype=grad.dtype, device=grad.device)[:, None]
    return (grad / count).flip(0).cumsum(0).flip(0) + grad.sum(0, keepdim=True) / n


mixer.register_autograd(_mixer_backward, setup_context=_mixer_setup)


class Stage(MixerStage):
    """graph (up) | break (mixer) | graph (down); two live inputs, two outputs."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(torch.ops.pptest_rt.mixer, H, seed)


class HalfStage(nn.Module):
    """Returns an output whose token dim is ``s0 // 2``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h.view(h.shape[0] // 2, -1)


def compile_stage(m: nn.Module, **options: Any) -> Any:
    """``m`` under ``pp_breakable``; the graph path's emulation unless ``options`` name another graph mode
    (these tests check graph semantics, which ``"auto"`` does not take on CPU)."""
    opts = {"capture_sizes": SIZES, "split_ops": ["pptest_rt::mixer"], "graph_mode": "emulate", **options}
    return torch.compile(m, backend="pp_breakable", dynamic=True, fullgraph=True, options=opts)


def inputs(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(n, H, generator=g), torch.randn(n, H, generator=g)


def check(compiled: Any, m: nn.Module, n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``compiled``'s outputs for ``n`` tokens, checked against ``m``'s."""
    args = inputs(n, seed)
    got = compiled(*args)
    want = m(*args)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w)
    return got


def only_state(rt: StageRuntime) -> StageInstance:
    (state,) = rt.instances()
    return state


def graph_steps(rt: StageRuntime) -> list[int]:
    return [st.index for st in rt.program.steps if st.segment.is_graph]

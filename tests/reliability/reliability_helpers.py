"""Small stages and helpers shared by the reliability tests.

``Stage`` is graph (up) | break (``pptest_rel::mixer``) | graph (down), with two live inputs and two
outputs. The mixer's rows depend on every live row (causal mean plus the overall mean), so a break that
saw padding or a graph that read a stale buffer gives a visibly different answer. ``HOOK`` lets a test
make the break op raise, block, or call back into the stage while it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from mixer_stage import MixerStage, register_mixer
from torch import nn

import ppcompile
from ppcompile.runtime.stage_runtime import StageRuntime

H = 8
SIZES = [4, 8, 16]
HOOK: dict[str, Callable[[torch.Tensor], None] | None] = {"fn": None}


def _run_hook(x: torch.Tensor) -> None:
    hook = HOOK["fn"]
    if hook is not None:
        hook(x)


mixer = register_mixer("pptest_rel::mixer", _run_hook)


class Stage(MixerStage):
    """graph (up) | break (mixer) | graph (down); inputs ``x``, ``residual``; two outputs."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(torch.ops.pptest_rel.mixer, H, seed)


class FeedbackStage(nn.Module):
    """A break that reads a live input after a graph segment wrote its static output ``y``.

    Feeding ``y`` of one call back in as ``x`` of the next makes ``x`` alias the memory that the graph
    overwrites before the break reads ``x``.
    """

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.lin = nn.Linear(H, H)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.tanh(self.lin(x))
        z = torch.ops.pptest_rel.mixer(x)
        return y * 2 + z, y


OPTIONS: dict[str, Any] = {"capture_sizes": SIZES, "split_ops": ["pptest_rel::mixer"],
                           "graph_mode": "emulate"}


def compile_stage(m: nn.Module, **options: Any) -> Any:
    """``m`` under ``pp_breakable``, on the graph path's emulation unless ``options`` name another graph
    mode: the faults, bad inputs and stale outputs checked here are those of graphs and static buffers."""
    opts = {**OPTIONS, **options}
    return torch.compile(m, backend="pp_breakable", dynamic=True, fullgraph=True, options=opts)


def no_guards(guards: list[Any]) -> list[bool]:
    """A ``guard_filter_fn`` that drops every Dynamo guard (as engines with custom dispatchers do)."""
    return [False for _ in guards]


def inputs(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(n, H, generator=g), torch.randn(n, H, generator=g)


def assert_matches(got: Any, want: Any) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape, (g.shape, w.shape)
        torch.testing.assert_close(g, w)


def check(compiled: Any, m: nn.Module, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Calls the compiled and the eager stage on ``args``; asserts equal outputs; returns the compiled."""
    got = compiled(*args)
    assert_matches(got, m(*args))
    return tuple(got)


def runtime() -> StageRuntime:
    """The newest runtime with a dynamic token dim."""
    return [rt for rt in ppcompile.stage_runtimes() if rt.token_symbol is not None][-1]


def only_state(rt: StageRuntime) -> Any:
    (state,) = rt.instances()
    return state


def static_snapshot(rt: StageRuntime) -> list[torch.Tensor]:
    """Copies of every static tensor of ``rt`` (to show that a rejected call wrote nothing)."""
    return [t.clone() for state in rt.instances() for t in state.static_tensors()]

"""Tensors a stage reaches outside its call's arguments (a closure cell, a global, a plain module attribute)
are state, read in place like parameters: an engine's kernel handle (a 0-d tensor holding a pointer, as
vLLM's CPU linear op takes) is not a live input copied into a static buffer at every call. The op below
fails on a handle of 0, as a null pointer would."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import ppcompile

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

H = 8


@torch.library.custom_op("pptest_state::with_handle", mutates_args=())
def with_handle(x: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
    """Scales ``x`` by the handle's value; a handle of 0 (a null pointer) fails, as the real op would."""
    if int(handle) == 0:
        raise RuntimeError("pptest_state::with_handle: null handle")
    return x * float(handle)


@with_handle.register_fake
def _(x: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


OPTIONS = {"graph_mode": "emulate", "capture_sizes": [4, 8], "token_local_ops": ["pptest_state::with_handle"]}
GLOBAL_HANDLE = torch.tensor(3, dtype=torch.int64)


def _attention(h: torch.Tensor) -> torch.Tensor:
    q = h.view(h.shape[0], 1, 2, H // 2)
    return torch.nn.functional.scaled_dot_product_attention(q, q, q).reshape(h.shape[0], H)


def _closure_stage() -> torch.nn.Module:
    handle = torch.tensor(2, dtype=torch.int64)  # reached through a closure cell
    lin = torch.nn.Linear(H, H)

    class Stage(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return with_handle(_attention(lin(x)), handle)

    return Stage()


class GlobalStage(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return with_handle(_attention(self.lin(x)), GLOBAL_HANDLE)


class AttributeStage(GlobalStage):
    def __init__(self) -> None:
        super().__init__()
        self.handle = torch.tensor(5, dtype=torch.int64)  # a plain attribute, not a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return with_handle(_attention(self.lin(x)), self.handle)


@pytest.mark.parametrize("make", [_closure_stage, GlobalStage, AttributeStage],
                         ids=["closure", "global", "attribute"])
def test_a_handle_outside_the_arguments_is_read_in_place_and_graphs_serve(make: Callable[[], Any]) -> None:
    stage = make()
    compiled = torch.compile(stage, backend="pp_breakable", options=OPTIONS)
    with torch.no_grad(), ppcompile.counters.expect(replays=3, eager_runs=0):
        for i, n in enumerate((5, 8, 3)):
            x = torch.randn(n, H, generator=torch.Generator().manual_seed(i))
            if i == 0:
                ppcompile.mark_token_dynamic(x)
            torch.testing.assert_close(compiled(x), stage(x))
    (runtime,) = ppcompile.stage_runtimes()
    (handle,) = [i for i, name in enumerate(runtime.compiled.input_names) if "handle" in name.lower()]
    assert handle in runtime.compiled.state_slots
    (instance,) = runtime.instances()
    assert handle not in instance.input_buffers  # no static buffer, no copy per call


def test_a_handle_passed_as_an_argument_is_a_live_input() -> None:
    """The other side of the rule: a tensor the call passes is per-call data, copied into its static
    buffer at every call."""
    lin = torch.nn.Linear(H, H)

    def stage(x: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
        return with_handle(_attention(lin(x)), handle)

    compiled = torch.compile(stage, backend="pp_breakable", options=OPTIONS)
    x, handle = torch.randn(5, H), torch.tensor(2, dtype=torch.int64)
    ppcompile.mark_token_dynamic(x)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, handle), stage(x, handle))
    (runtime,) = ppcompile.stage_runtimes()
    (slot,) = [i for i, name in enumerate(runtime.compiled.input_names) if "handle" in name.lower()]
    assert slot in runtime.compiled.tensor_slots and slot not in runtime.compiled.state_slots

"""``runtime/state_match.py``: an instance's generated matcher says True exactly when a call's module-state
key equals the instance's (``CapturePolicy._state_key``), and the runtime serves each call by the right
instance when calls of several instances interleave."""

from __future__ import annotations

import pytest
import torch
from mixer_runtime import Stage, check, compile_stage, symbolic_runtime

from ppcompile import counters
from ppcompile.runtime.state_match import state_matcher

STATE, SCALARS = (1, 2, 3), (4, 5)
pytestmark = pytest.mark.usefixtures("fresh_mixer")


def _args() -> list[object]:
    return [torch.randn(3), torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.tensor(1e-6),
            torch.tensor(2, device="meta")]


def test_a_matcher_holds_every_slot_to_its_instance() -> None:
    args = _args()
    matches = state_matcher(STATE, SCALARS, args, "stage")
    assert matches(args) and matches([torch.randn(3), *args[1:]])  # a token input is not state
    for slot in STATE:  # another tensor of equal values in any state slot
        other = list(args)
        other[slot] = args[slot].clone()
        assert not matches(other), slot
    changed = list(args)
    changed[4] = torch.tensor(1e-5)  # a host scalar by value
    assert not matches(changed)
    assert matches([*args[:4], torch.tensor(1e-6), args[5]])  # equal value, another tensor
    moved = list(args)
    moved[5] = torch.tensor(2, device="meta")  # a device scalar by identity
    assert not matches(moved)
    with torch.inference_mode():
        assert not matches(args)  # the instance's tensors belong to the other mode
        assert state_matcher(STATE, SCALARS, args, "stage")(args)


@pytest.mark.parametrize("order", ["alternating", "runs"])
def test_interleaved_calls_of_two_instances_are_each_served_by_their_own(order: str) -> None:
    m1, m2 = Stage(seed=1), Stage(seed=2)
    c1, c2 = compile_stage(m1), compile_stage(m2)
    calls = [(c1, m1), (c2, m2)] * 3 if order == "alternating" else [(c1, m1)] * 3 + [(c2, m2)] * 3
    for i, (c, m) in enumerate([(c1, m1), (c2, m2), *calls]):
        check(c, m, 5 + i % 4, seed=i)  # compared with the module's own eager forward
    rt = symbolic_runtime(m1)
    assert len(rt.instances()) == 2 and counters.backend_compiles == 1

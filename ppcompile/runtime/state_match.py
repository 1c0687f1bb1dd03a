"""Whether a call belongs to a module instance, in one generated expression.

A ``StageRuntime`` keys its module instances by a call's module state (``CapturePolicy._state_key``): the
identity of each parameter and buffer, the value of each constant host scalar (a device scalar by
identity), and inference mode. Building that key walks the whole state into a tuple and hashes it, a few
hundred slots per call for a deep stage. A call almost always belongs to the instance the call before it
did, so the runtime first asks that instance's matcher, generated once per instance, with its objects
bound as the function's defaults (read as locals)::

    def state_matches(args, inference_mode=..., s0=..., s1=..., v0=...):
        return (inference_mode() is True and args[2] is s0 and args[3] is s1 and ...
                and (a := args[40]).device.type == "cpu" and a.item() == v0)

True exactly when the call's key equals the instance's: the instance holds its state tensors, so no
other object can take their identities. A miss falls back to the key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["StateMatcher", "state_matcher"]

StateMatcher = Callable[[Sequence[Any]], bool]


def state_matcher(state_slots: Sequence[int], scalar_slots: Sequence[int], args: Sequence[Any],
                  stage: str) -> StateMatcher:
    """The matcher of the instance whose module state is ``args``' (at ``state_slots``, and the scalars at
    ``scalar_slots``), in the current inference mode; ``stage`` names the generated code."""
    names: dict[str, Any] = {"inference_mode": torch.is_inference_mode_enabled}
    terms = [f"inference_mode() is {torch.is_inference_mode_enabled()}"]
    for k, slot in enumerate(state_slots):
        names[f"s{k}"] = args[slot]
        terms.append(f"args[{slot}] is s{k}")
    for k, slot in enumerate(scalar_slots):
        scalar = args[slot]
        if scalar.device.type == "cpu":
            names[f"v{k}"] = scalar.item()
            terms.append(f'(a := args[{slot}]).device.type == "cpu" and a.item() == v{k}')
        else:
            names[f"d{k}"] = scalar
            terms.append(f"args[{slot}] is d{k}")
    defaults = ", ".join(f"{name}={name}" for name in names)
    source = f"def state_matches(args, {defaults}):\n    return (" + "\n            and ".join(terms) + ")\n"
    scope = dict(names)
    exec(compile(source, f"<ppcompile state_matches {stage}>", "exec"), scope)
    matches: StateMatcher = scope["state_matches"]
    return matches

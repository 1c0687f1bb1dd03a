"""``pp_breakable`` with its options bound, for engines that own the ``torch.compile`` call and pass no
``options=`` (vLLM hands its ``compilation_config`` options to Inductor only).

Three ways, checked the same as ``options=`` (``PPBreakableConfig.from_options``):

* ``PPCOMPILE_OPTIONS='{"graph_mode": "emulate"}'`` in the environment: read by the registered backend
  at every compile, so spawned workers that inherit the environment get them too (``envs.options``);
* ``backend_with_options(options)``: a backend callable, ``torch.compile(m, backend=...)``;
* ``register_backend_with_options(name, options)``: the same under a name, for engines that take a
  backend's name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ppcompile.config import PPBreakableConfig
from ppcompile.torch_internals import register_backend

from .pp_breakable import pp_breakable

__all__ = ["backend_with_options", "register_backend_with_options"]


def backend_with_options(options: Mapping[str, Any]) -> Callable[..., Any]:
    """The ``pp_breakable`` backend with ``options`` bound (over ``PPCOMPILE_OPTIONS``), checked now:
    a bad option raises here, not at the first compile."""
    PPBreakableConfig.from_options(options)
    bound = dict(options)

    def pp_breakable_with_options(gm: torch.fx.GraphModule, example_inputs: list[Any], **_: Any) -> Any:
        return pp_breakable(gm, example_inputs, bound)

    return pp_breakable_with_options


def register_backend_with_options(name: str, options: Mapping[str, Any]) -> None:
    """Registers ``backend_with_options(options)`` as the Dynamo backend ``name``
    (``torch.compile(m, backend=name)``); a name Dynamo already knows raises ``ValueError``."""
    if not isinstance(name, str) or not name or name == "pp_breakable":
        raise ValueError(f"register_backend_with_options: name must be a new backend name, got {name!r}")
    if not register_backend(backend_with_options(options), name):
        raise ValueError(f"register_backend_with_options: Dynamo already has a backend named {name!r}")

"""Fixtures of the FX pass tests: the custom op that stands for a user split op."""

from __future__ import annotations

import torch

import ppcompile.models  # noqa: F401  (registers torch.ops.ppcompile.attention)

if not hasattr(torch.ops.pptest, "mix"):

    @torch.library.custom_op("pptest::mix", mutates_args=())
    def _mix(x: torch.Tensor) -> torch.Tensor:
        """A stand-in for a user op listed in ``split_ops``: pointwise, so easy to check."""
        return x * 2.0 + 1.0

    @_mix.register_fake
    def _mix_fake(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

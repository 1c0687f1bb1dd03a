"""The copies a traced-once region is called through (``ppcompile.trace_layers_once``'s regions).

A nested compile region may not alias its inputs or outputs, so ``trace_layers_once`` passes each
tensor in and out through ``region_copy`` and writes each input back after the call
(``region_write_back``); the backend's ``inline_nested_regions`` pass removes both again.
"""

from __future__ import annotations

import torch

__all__ = ["region_copy", "region_write_back"]


@torch.library.custom_op("ppcompile::region_copy", mutates_args=())
def region_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x``: what a traced-once region takes and returns, so that no region input or output
    aliases another. ``inline_nested_regions`` replaces each call by ``x`` itself."""
    return x.clone()


@region_copy.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("ppcompile::region_write_back", mutates_args=("dst",))
def region_write_back(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copies a region's copy of an input back into the input, in case the region wrote it in place.
    ``inline_nested_regions`` drops it (the inlined region writes the input itself)."""
    dst.copy_(src)


@region_write_back.register_fake
def _(dst: torch.Tensor, src: torch.Tensor) -> None:
    return None

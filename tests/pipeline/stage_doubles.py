"""Stage doubles shared by the pipeline tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ppcompile.models import PPStage


class EmbedsFirstStage(nn.Module):
    """A first stage taking ``inputs_embeds`` instead of ``input_ids`` or proxies (layers of ``inner``)."""

    def __init__(self, inner: PPStage) -> None:
        super().__init__()
        self.inner = inner
        self.start_layer, self.end_layer = inner.start_layer, inner.end_layer

    def forward(self, positions: torch.Tensor, inputs_embeds: torch.Tensor) -> Any:
        hidden, residual = inputs_embeds, None
        for i in range(self.start_layer, self.end_layer):
            hidden, residual = self.inner.layers[i](positions, hidden, residual)
        return {"hidden_states": hidden, "residual": residual}

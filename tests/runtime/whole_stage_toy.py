"""A toy stage with a capturable break for whole-stage graph tests: ``pptest::causal_mix`` sums, for each
token, the rows of its request up to it (attention's data flow without its arithmetic) and writes each
live row into a cache at its slot. It reads its metadata from tensors only, so it honours the capture
contract: a padded row (slot -1, or beyond the last request start) writes nothing and outputs zero; a
padded request (zero length) holds no row."""

from __future__ import annotations

import torch
from torch import nn

from ppcompile.capturable import Metadata, Rows, declare_capturable

__all__ = ["CONTRACT", "MixStage", "make_meta", "reference"]


def _rows_of_requests(starts: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: its request (by ``searchsorted``, no host read), and whether it belongs to one."""
    index = torch.arange(rows, device=starts.device, dtype=starts.dtype)
    request = torch.searchsorted(starts[1:].contiguous(), index, right=True)
    return request, index < starts[-1]


@torch.library.custom_op("pptest::causal_mix", mutates_args=("cache",))
def causal_mix(x: torch.Tensor, cache: torch.Tensor, starts: torch.Tensor,
               slots: torch.Tensor) -> torch.Tensor:
    request, live = _rows_of_requests(starts, x.shape[0])
    same = (request[:, None] == request[None, :]) & live[:, None] & live[None, :]
    index = torch.arange(x.shape[0], device=x.device)
    mask = same & (index[None, :] <= index[:, None])
    out = mask.to(x.dtype) @ x
    valid = slots >= 0
    # Rows that write nothing rewrite what row 0 writes (or the old row 0 when row 0 is padding too):
    # identical duplicate writes, so the result does not depend on their order.
    first = torch.where(valid[0], slots[0], torch.zeros_like(slots[0]))
    target = torch.where(valid, slots, first)
    fallback = torch.where(valid[0], x[0], cache.index_select(0, first.reshape(1))[0])
    cache.index_put_((target,), torch.where(valid[:, None], x, fallback))
    return out


@causal_mix.register_fake
def _(x: torch.Tensor, cache: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


CONTRACT = {"starts": Metadata(Rows.REQUEST_STARTS), "slots": Metadata(Rows.TOKENS, pad=-1)}
declare_capturable("pptest::causal_mix", CONTRACT)


def reference(x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """``causal_mix``'s output, request by request."""
    parts, start = [], 0
    for n in lens:
        parts.append(torch.cumsum(x[start:start + n], 0))
        start += n
    return torch.cat(parts)


class MixLayer(nn.Module):
    """``x + out(causal_mix(in(x)))``; its cache is a buffer of its own (read in place by every path)."""

    def __init__(self, hidden: int, slots: int) -> None:
        super().__init__()
        self.inp = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)
        self.register_buffer("cache", torch.zeros(slots, hidden), persistent=False)

    def forward(self, x: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.ops.pptest.causal_mix(self.inp(x), self.cache, starts, slots))


class MixStage(nn.Module):
    """``layers`` :class:`MixLayer` s."""

    def __init__(self, hidden: int = 8, layers: int = 2, slots: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(MixLayer(hidden, slots) for _ in range(layers))

    def forward(self, x: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, starts, slots)
        return x

    def caches(self) -> list[torch.Tensor]:
        return [layer.cache for layer in self.layers]


def make_meta(lens: list[int], first_slot: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(request starts ``[R + 1]`` int32, slots ``[T]`` int64) for requests of ``lens`` tokens."""
    starts = torch.zeros(len(lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(lens), 0)
    return starts, torch.arange(first_slot, first_slot + sum(lens), dtype=torch.int64)

"""An asynchronous send of a default (owned) stage output, not waited before the stage's next calls,
delivers the values the stage returned.

Two gloo ranks. Rank 0 runs a compiled stage (graph path, emulated) on several inputs of one bucket and
sends each output with ``dist.isend`` as soon as it returns, waiting for none of the sends until the end;
rank 1 posts its receives only after rank 0 is done. Gloo reads a send's tensor when the matching receive
arrives, so every send reads its tensor after the stage's later calls ran. With owned outputs (the
default) each received tensor equals eager's; with views into graph memory (``owned_outputs=False``)
every send but the last reads the last call's rows (the teeth).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ppcompile
from ppcompile.pipeline import spawn_ranks

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

H = 16
TOKENS = (5, 6, 7, 8)  # one bucket (8): every call rewrites the same graph memory


class Stage(nn.Module):
    """A linear, an attention break, a linear: two graph segments around SDPA."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(H, H), nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        q = h.view(h.shape[0], 1, 2, H // 2)
        a = torch.nn.functional.scaled_dot_product_attention(q, q, q).reshape(h.shape[0], H)
        return self.down(a + h)


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, H, generator=g) for n in TOKENS]


def _sender_and_receiver(rank: int, world: int, options: dict[str, Any]) -> list[torch.Tensor]:
    torch.manual_seed(0)
    stage = Stage()
    if rank == 1:
        dist.barrier()  # after every send was posted and the stage ran again
        received = [torch.empty(n, H) for n in TOKENS]
        for t in received:
            dist.recv(t, src=0)
        return received
    compiled = torch.compile(stage, backend="pp_breakable", options={"capture_sizes": [8], **options})
    xs = _inputs()
    ppcompile.mark_token_dynamic(xs[0])
    works = []
    with torch.inference_mode():
        for x in xs:
            works.append(dist.isend(compiled(x), dst=1))
    assert ppcompile.counters.replays == len(TOKENS)
    dist.barrier()
    for w in works:
        w.wait()
    return []


def _eager() -> list[torch.Tensor]:
    torch.manual_seed(0)
    stage = Stage()
    with torch.inference_mode():
        return [stage(x) for x in _inputs()]


def test_an_unwaited_send_of_a_default_output_delivers_its_values() -> None:
    _, received = spawn_ranks(_sender_and_receiver, 2, args=({"graph_mode": "emulate"},), threads=1,
                              timeout_s=120, pg_timeout_s=30)
    for got, want in zip(received, _eager()):
        torch.testing.assert_close(got, want)


def test_with_views_an_unwaited_send_reads_a_later_calls_rows() -> None:
    options = {"graph_mode": "emulate", "owned_outputs": False}
    _, received = spawn_ranks(_sender_and_receiver, 2, args=(options,), threads=1, timeout_s=120,
                              pg_timeout_s=30)
    wrong = [i for i, (got, want) in enumerate(zip(received, _eager())) if not torch.allclose(got, want)]
    assert wrong == list(range(len(TOKENS) - 1)), wrong

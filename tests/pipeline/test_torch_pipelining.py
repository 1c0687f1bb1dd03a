"""PyTorch's own ``torch.distributed.pipelining`` driving ``pp_breakable`` stages at default options.

``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B``, forward only (no loss: inference), on 2 and 4
gloo ranks. Each stage is ``torch.compile(core, backend="pp_breakable", options=OPTIONS)``, OPTIONS being
``graph_mode="emulate"`` (the CPU stand-in for CUDA graphs) and nothing else. Every step's packed batch
(``input_ids [T]``, ``positions [T]``) is chunked by pipelining (default ``TensorChunkSpec(0)``:
``torch.tensor_split``) into ``N_MICRO`` micro-batches of unequal token counts, and ``T`` changes from step
to step. The last stage's logits, merged by the schedule, must equal the unsplit eager model's.

What pipelining requires (torch 2.13, read in ``stage.py`` / ``schedules.py`` and checked on 2 ranks):
a stage's receive buffers are allocated once, at the first ``step()``, one per micro-batch index, shaped
from micro-batch 0 (metadata inference) or from ``input_args`` (static mode), and reused for every later
micro-batch and step. A smaller message is received silently into the front of the buffer (the rest stale:
T=13 in 4 micro-batches of 4, 3, 3, 3 comes out as 16 rows of logits), a larger one aborts the receiving
rank (gloo: "Received data size doesn't match expected size"). Unequal micro-batches cannot travel between
stages as they are. So here:

- Activations travel padded to ``WIRE_TOKENS`` rows, and each ``PipelineStage`` is given ``input_args`` and
  ``output_args`` of that shape (static mode: no metadata forward on empty tensors, no shape inference).
- Every rank passes ``positions`` to ``step()`` as a keyword argument; pipelining chunks it like
  ``input_ids``, so each stage learns its micro-batch's live token count from it (no value read back).
- ``WireStage`` (eager) slices the live rows off the wire, calls the compiled core on them and pads the
  core's output back to ``WIRE_TOKENS`` rows. The last stage's logits are not sent: the schedule merges
  them. torch 2.11 checks a last stage's outputs against its ``output_args`` too, so the last core runs on
  the whole wire (its live rows, then zeros; positions padded likewise) and returns ``WIRE_TOKENS`` rows
  of logits as they come (a view into graph memory unless outputs are owned); the test keeps each
  micro-batch's live rows of the merged logits.

The first and middle cores thus see the live, unequal token counts; pipelining sees fixed shapes.
Attention (SDPA, a break) mixes the slots of one token only, so neither the micro-batch split nor the
padding rows can change a live row.

What it guards: the schedule keeps every micro-batch's logits until it merges them at the end of
``step()``, past later calls of the last stage. Outputs that are views into graph memory
(``owned_outputs=False``) would give every micro-batch the leading rows of the last micro-batch's logits
(max error about 2). The other stages' outputs are copied by the padding before they are sent.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import ppcompile
from ppcompile.pipeline import spawn_ranks

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

OPTIONS: dict[str, Any] = {"graph_mode": "emulate"}  # defaults otherwise: that is the point of this test
HIDDEN, SLOTS, VOCAB, MAX_POS, NUM_BLOCKS = 32, 4, 61, 32, 4
N_MICRO = 4  # 1F1B needs at least as many micro-batches as stages
STEPS = (13, 22, 9, 30)  # tokens per step: micro-batches [4,3,3,3] [6,6,5,5] [3,2,2,2] [8,8,7,7]
WIRE_TOKENS = 8  # rows of every activation on the wire: the largest micro-batch
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def _rms_norm(h: torch.Tensor) -> torch.Tensor:
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


class Block(nn.Module):
    """Positional term, SDPA among the ``SLOTS`` slots of each token (token-local), MLP; residuals."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(MAX_POS, HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = h + self.pos(positions)
        t = h.shape[0]
        q, k, v = self.qkv(_rms_norm(h)).view(t, 3, 1, SLOTS, HIDDEN // SLOTS).unbind(1)
        attended = F.scaled_dot_product_attention(q, k, v)  # [t, 1, SLOTS, HIDDEN // SLOTS]
        h = h + self.proj(attended.reshape(t, HIDDEN))
        return h + self.down(F.gelu(self.up(_rms_norm(h))))


class StageCore(nn.Module):
    """One stage of the model: ``[embedding] -> blocks -> [norm, lm head]``, token-major in and out."""

    def __init__(self, embed: nn.Embedding | None, blocks: list[Block], head: nn.Linear | None) -> None:
        super().__init__()
        self.embed = embed
        self.blocks = nn.ModuleList(blocks)
        self.head = head

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for block in self.blocks:
            h = block(h, positions)
        return self.head(_rms_norm(h)) if self.head is not None else h


def make_cores(world: int) -> list[StageCore]:
    """The seeded model cut into ``world`` stages of ``NUM_BLOCKS // world`` blocks (eager modules)."""
    torch.manual_seed(0)
    embed, head = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB)
    blocks = [Block() for _ in range(NUM_BLOCKS)]
    per = NUM_BLOCKS // world
    return [StageCore(embed if r == 0 else None, blocks[r * per:(r + 1) * per],
                      head if r == world - 1 else None) for r in range(world)]


class WireStage(nn.Module):
    """What ``PipelineStage`` runs: live rows off the fixed-size wire, the compiled core, padded back on."""

    def __init__(self, core: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *, first: bool,
                 last: bool) -> None:
        super().__init__()
        self.core, self.first, self.last = core, first, last
        self.marked = False

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n = positions.shape[0]
        if n > WIRE_TOKENS:
            raise ValueError(f"micro-batch of {n} tokens does not fit the {WIRE_TOKENS}-row wire")
        if self.last:  # the whole wire: the logits' shape is the output_args' (module docstring)
            live, positions = x, F.pad(positions, (0, WIRE_TOKENS - n))
        else:
            live = x if self.first else x[:n]
        if not self.marked:  # the first call's token dims, as the user guide recommends
            ppcompile.mark_token_dynamic(live, positions)
            self.marked = True
        out = self.core(live, positions)
        return out if self.last else F.pad(out, (0, 0, 0, WIRE_TOKENS - n))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s packed batch: ``input_ids [T]`` and ``positions [T]`` of a few sequences."""
    total = STEPS[step]
    rng = random.Random(step)
    cuts = sorted(rng.sample(range(1, total), 2))
    positions = torch.cat([torch.arange(b - a) for a, b in zip([0, *cuts], [*cuts, total])])
    ids = torch.randint(VOCAB, (total,), generator=torch.Generator().manual_seed(step))
    return ids, positions


def _reference() -> list[torch.Tensor]:
    cores = make_cores(1)
    with torch.inference_mode():
        return [cores[0](*_batch(step)) for step in range(len(STEPS))]


class _Warnings(logging.Handler):
    """Collects what ``ppcompile`` logs at WARNING and above (a stage falling off the graph path)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.name}: {record.getMessage()}")


def _rank_worker(rank: int, world: int, schedule_name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Runs every step through this rank's stage; returns the merged logits (last rank), counters, how
    many stage graphs Dynamo compiled and ppcompile's warnings."""
    torch._dynamo.reset()
    ppcompile.counters.reset()
    logged = _Warnings()
    logging.getLogger("ppcompile").addHandler(logged)
    core = make_cores(world)[rank]
    compiled = torch.compile(core, backend="pp_breakable", options=options)
    first, last = rank == 0, rank == world - 1
    wire_in = torch.zeros(WIRE_TOKENS, dtype=torch.long) if first else torch.zeros(WIRE_TOKENS, HIDDEN)
    wire_out = torch.zeros(WIRE_TOKENS, VOCAB if last else HIDDEN)
    stage = PipelineStage(WireStage(compiled, first=first, last=last), rank, world, torch.device("cpu"),
                          input_args=wire_in, output_args=wire_out)
    schedule = SCHEDULES[schedule_name](stage, n_microbatches=N_MICRO)
    logits = []
    with torch.inference_mode():
        for step in range(len(STEPS)):
            ids, positions = _batch(step)
            out = schedule.step(*([ids] if first else []), positions=positions)
            if last:  # each micro-batch's live rows of its WIRE_TOKENS rows
                sizes = [len(c) for c in torch.tensor_split(positions, N_MICRO)]
                rows = [out[j * WIRE_TOKENS:j * WIRE_TOKENS + s] for j, s in enumerate(sizes)]
                logits.append(torch.cat(rows))
    return {"logits": logits, "counters": ppcompile.counters.snapshot(),
            "stage_graphs": len(ppcompile.stage_runtimes()), "warnings": logged.messages}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_schedule_logits_match_unsplit_eager(schedule: str, world: int) -> None:
    """Unequal micro-batches, a token count per step: the merged logits are the unsplit eager model's,
    served by graphs on every rank."""
    results = spawn_ranks(_rank_worker, world, args=(schedule, OPTIONS), threads=1, timeout_s=120,
                          pg_timeout_s=30)
    got, want = results[-1]["logits"], _reference()
    assert len(got) == len(want) == len(STEPS)
    for step, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5,
                                   msg=lambda m, step=step: f"step {step} ({STEPS[step]} tokens): {m}")
    ranks = [{"replays": r["counters"]["replays"], "eager_runs": r["counters"]["eager_runs"],
              "stage_graphs": r["stage_graphs"]} for r in results]
    assert all(r["replays"] > 0 for r in ranks), f"a rank never replayed a graph: {ranks}"
    assert not any(r["warnings"] for r in results), [r["warnings"] for r in results]


def test_views_kept_by_the_schedule_are_overwritten() -> None:
    """The test above has teeth: with views into graph memory (``owned_outputs=False``, the default before
    outputs were owned) the logits the schedule keeps until its merge are overwritten by later
    micro-batches."""
    results = spawn_ranks(_rank_worker, 2, args=("gpipe", {**OPTIONS, "owned_outputs": False}), threads=1,
                          timeout_s=120, pg_timeout_s=30)
    wrong = [step for step, (g, w) in enumerate(zip(results[-1]["logits"], _reference()))
             if not torch.allclose(g, w, atol=1e-3, rtol=1e-3)]
    assert wrong == list(range(len(STEPS))), wrong

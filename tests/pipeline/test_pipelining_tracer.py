"""Stages cut by ``torch.distributed.pipelining``'s tracer (``pipe_split`` + ``pipeline()``) under
``pp_breakable``: aten-level graphs break where the torch-level graph would, at attention only.

The tracer exports the model (``torch.export``) and splits the aten graph at each ``pipe_split()``; each
stage module holds aten ops (``aten.embedding(weight, indices)``, RoPE's ``x[..., :d]`` as
``aten.slice.Tensor``, ``.to(dtype)`` as ``aten._assert_tensor_metadata`` + ``aten.to.dtype``). Every stage
module is compiled as a user would: ``ppcompile.mark_first_call(torch.compile(module, backend=...))``, so
that its first call marks its token dims.

In one process, the stages are walked by the pipe's split graph as its local runner does (it feeds stage
0 ``(positions, input_ids)``: the order of the stage's placeholders, not the model's arguments). The
logits must be the eager model's at 1 token, a bucket, a bucket + 1, the cap and above it, graphs must
serve the bucketed counts, and each stage must break once per decoder layer: at its attention.

On 2 gloo ranks, each rank traces the same pipe, builds its stage with ``pipe.build_stage`` and sets
``stage.submod`` to the compiled, marking module; ``ScheduleGPipe`` / ``Schedule1F1B`` run it forward
only. Pipelining's traced stages size their receive buffers from the traced example (``mb_args``), so every
micro-batch of every step has its token count: ``N_MICRO`` micro-batches of ``MICRO_TOKENS`` tokens, other
token values each step. One count only is exactly the case ``mark_first_call`` exists for: unmarked,
Dynamo traces it as a constant and the stage never graphs (checked too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ppcompile
from ppcompile.pipeline import spawn_ranks
from ppcompile.records import BreakKind

pytestmark = [pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="needs torch.distributed with gloo"),
              pytest.mark.usefixtures("fresh_dynamo", "one_thread")]

VOCAB, HIDDEN, HEADS, HEAD_DIM, NUM_LAYERS = 61, 32, 4, 8, 4
SIZES = [4, 8, 16]
# Graph segments between breaks are never folded into breaks here: every break the checks make counts.
OPTIONS: dict[str, Any] = {"capture_sizes": SIZES, "graph_mode": "emulate", "fold_graph_ops": 0}
# (tokens, bucket or None for eager), the first call's count marked: a bucket, bucket + 1, 1 token, the
# cap, above the cap
COUNTS: list[tuple[int, int | None]] = [(8, 8), (9, 16), (1, None), (16, 16), (21, None)]
# The multi-rank runs: capture sizes and graph_mode only (default fold_graph_ops), the traced count per
# micro-batch, 1F1B needing as many micro-batches as stages.
RANK_OPTIONS: dict[str, Any] = {"capture_sizes": SIZES, "graph_mode": "emulate"}
MICRO_TOKENS, N_MICRO, STEPS = SIZES[1], 2, 3


class RMSNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, HIDDEN))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        dtype = h.dtype
        x = h.to(torch.float32)  # exported as aten._assert_tensor_metadata + aten.to.dtype
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return torch.cat((-x[..., d:], x[..., :d]), dim=-1)  # aten.slice.Tensor on the last dim


class Layer(nn.Module):
    """Pre-norm decoder layer: RoPE'd causal SDPA over the heads of one sequence, gated MLP. Views use
    ``-1`` for the tokens: the tracer exports at one token count, and ``-1`` keeps it out of the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(), RMSNorm()
        self.qkv = nn.Linear(HIDDEN, 3 * HEADS * HEAD_DIM, bias=False)
        self.o = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.gate_up = nn.Linear(HIDDEN, 4 * HIDDEN, bias=False)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.attn_norm(h)).view(-1, 3, HEADS, HEAD_DIM).unbind(1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              is_causal=True)
        h = h + self.o(attn.transpose(0, 1).reshape(-1, HEADS * HEAD_DIM))
        gate, up = self.gate_up(self.mlp_norm(h)).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up)


class Decoder(nn.Module):
    """Embedding, rotary tables from ``positions``, ``NUM_LAYERS`` layers, norm and LM head; token-major
    (``input_ids [T]``, ``positions [T]``). A ``pipe_split()`` before the middle layer cuts 2 stages."""

    inv_freq: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(NUM_LAYERS))
        self.norm = RMSNorm()
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        from torch.distributed.pipelining import pipe_split

        freqs = positions[:, None].float() * self.inv_freq
        table = torch.cat((freqs, freqs), dim=-1)
        cos, sin = table.cos()[:, None], table.sin()[:, None]  # [T, 1, HEAD_DIM]
        h = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            if i == NUM_LAYERS // 2:
                pipe_split()
            h = layer(h, cos, sin)
        return self.head(self.norm(h))


def _batch(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(VOCAB, (tokens,), generator=torch.Generator().manual_seed(tokens))
    return ids, torch.arange(tokens)


class StageRunner(torch.fx.Interpreter):
    """Walks the pipe's split graph (stage calls and the picks of their outputs) with each stage
    submodule replaced by its compiled module."""

    def __init__(self, split_gm: torch.fx.GraphModule, stages: dict[str, Callable[..., Any]]) -> None:
        super().__init__(split_gm)
        self.stages = stages

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self.stages[str(target)](*args, **kwargs)


def _model() -> Decoder:
    torch.manual_seed(0)
    return Decoder().eval()


def _traced() -> tuple[Decoder, Any]:
    """The seeded model and its pipe, traced at ``MICRO_TOKENS`` tokens (every rank gets the same)."""
    from torch.distributed.pipelining import pipeline

    model = _model()
    pipe = pipeline(model, mb_args=_batch(MICRO_TOKENS))
    assert pipe.num_stages == 2
    return model, pipe


def _at(tokens: int) -> Callable[[str], str]:
    return lambda message: f"{tokens} tokens: {message}"


def _aten_targets(module: nn.Module) -> set[Any]:
    return {n.target for m in module.modules() if isinstance(getattr(m, "graph", None), torch.fx.Graph)
            for n in m.graph.nodes}  # type: ignore[union-attr]


def test_traced_stages_hold_the_aten_ops_that_used_to_break() -> None:
    """The stages this file compiles are aten graphs with the ops the checks once broke at."""
    _, pipe = _traced()
    targets = _aten_targets(pipe.split_gm)
    aten = torch.ops.aten
    assert {aten.embedding.default, aten.slice.Tensor, aten._assert_tensor_metadata.default, aten.to.dtype,
            aten.scaled_dot_product_attention.default} <= targets, targets


def test_traced_stages_match_eager_and_break_only_at_attention() -> None:
    model, pipe = _traced()
    stages: dict[str, Callable[..., Any]] = {
        name: ppcompile.mark_first_call(torch.compile(module, backend="pp_breakable", options=OPTIONS))
        for name, module in pipe.split_gm.named_children()}
    assert len(stages) == 2, list(stages)
    runner = StageRunner(pipe.split_gm, stages)
    for tokens, bucket in COUNTS:
        ids, positions = _batch(tokens)
        path = (ppcompile.counters.expect(replays=0, eager_runs=2, replays_by_bucket={}) if bucket is None
                else ppcompile.counters.expect(replays=2, eager_runs=0, replays_by_bucket={bucket: 2}))
        with torch.inference_mode():
            want = model(ids, positions)
            with path:
                (got,) = runner.run(ids, positions)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=_at(tokens))
    runtimes = [rt for rt in ppcompile.stage_runtimes() if rt.token_symbol is not None]
    assert len(runtimes) == 2, [rt.describe() for rt in ppcompile.stage_runtimes()]
    for rt in runtimes:
        assert [r.kind for r in rt.break_reasons] == [BreakKind.ATTENTION] * (NUM_LAYERS // 2), rt.describe()


def _step_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch of ``N_MICRO`` sequences of ``MICRO_TOKENS`` tokens: ``input_ids``,
    ``positions`` (each sequence's, shifted by ``step``)."""
    ids = torch.randint(VOCAB, (N_MICRO * MICRO_TOKENS,), generator=torch.Generator().manual_seed(100 + step))
    return ids, torch.arange(MICRO_TOKENS).repeat(N_MICRO) + step


def _stage_reference() -> list[torch.Tensor]:
    """The unsplit eager model's logits of every step. Its attention spans one call's tokens, and the
    schedule calls each stage once per micro-batch: one sequence each, so the model runs on each."""
    model = _model()
    with torch.inference_mode():
        return [torch.cat([model(*chunk) for chunk in zip(*(t.chunk(N_MICRO) for t in _step_batch(step)))])
                for step in range(STEPS)]


def _rank_worker(rank: int, world: int, schedule_name: str, marked: bool) -> dict[str, Any]:
    """Builds this rank's traced stage, compiled (and marking its first call's token dims if ``marked``),
    runs every step; returns the merged logits (last rank), each step's replays and eager runs, and the
    break kinds of the stage graphs compiled with a symbolic token count."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    torch._dynamo.reset()
    ppcompile.counters.reset()
    _, pipe = _traced()
    stage = pipe.build_stage(rank, torch.device("cpu"))
    # The first stage takes the model's inputs in its placeholders' order, (positions, input_ids): the
    # order the model first uses them. Its forward names them in the model's order, so passing them by name
    # swaps them, silently (torch 2.11 and 2.13).
    order = [n.name for n in stage.submod.graph.nodes if n.op == "placeholder"]
    compiled = torch.compile(stage.submod, backend="pp_breakable", options=RANK_OPTIONS)
    stage.submod = ppcompile.mark_first_call(compiled) if marked else compiled
    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name](stage, n_microbatches=N_MICRO)
    logits, steps = [], []
    with torch.inference_mode():
        for step in range(STEPS):
            batch = dict(zip(("input_ids", "positions"), _step_batch(step)))
            before = ppcompile.counters.snapshot()
            out = schedule.step(*(batch[name] for name in order)) if rank == 0 else schedule.step()
            after = ppcompile.counters.snapshot()
            steps.append({k: after[k] - before[k] for k in ("replays", "eager_runs")})
            if rank == world - 1:
                logits.append(out)
    symbolic = [rt for rt in ppcompile.stage_runtimes() if rt.token_symbol is not None]
    breaks = [[r.kind for r in rt.break_reasons] for rt in symbolic]
    return {"logits": logits, "steps": steps, "breaks": breaks,
            "described": [rt.describe() for rt in ppcompile.stage_runtimes()]}


def _assert_reference_logits(got: list[torch.Tensor]) -> None:
    want = _stage_reference()
    assert len(got) == len(want) == STEPS
    for step, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=_at_step(step))


def _at_step(step: int) -> Callable[[str], str]:
    return lambda message: f"step {step}: {message}"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_schedule_over_built_stages_graphs_from_the_first_step(schedule: str) -> None:
    """``pipe.build_stage`` + ``stage.submod = mark_first_call(compiled)`` on 2 ranks: the merged logits
    are the unsplit eager model's at every step, every rank replays a graph for every micro-batch from the
    first step on, and its stage breaks once per decoder layer it holds, at attention."""
    results = spawn_ranks(_rank_worker, 2, args=(schedule, True), threads=1, timeout_s=120, pg_timeout_s=30)
    _assert_reference_logits(results[-1]["logits"])
    for rank, result in enumerate(results):
        assert result["steps"] == [{"replays": N_MICRO, "eager_runs": 0}] * STEPS, (rank, result["steps"])
        assert result["breaks"] == [[BreakKind.ATTENTION] * (NUM_LAYERS // 2)], (rank, result["described"])


def test_unmarked_stages_never_graph_one_token_count() -> None:
    """Why ``mark_first_call``: compiled alone, a stage sees one token count only, which Dynamo traces as
    a constant; the static graph is served eagerly at every step (logits still right)."""
    results = spawn_ranks(_rank_worker, 2, args=("gpipe", False), threads=1, timeout_s=120, pg_timeout_s=30)
    _assert_reference_logits(results[-1]["logits"])
    for rank, result in enumerate(results):
        assert result["steps"] == [{"replays": 0, "eager_runs": N_MICRO}] * STEPS, (rank, result["steps"])
        assert result["breaks"] == [], (rank, result["described"])

"""Stages cut by ``torch.distributed.pipelining``'s tracer (``pipe_split`` + ``pipeline()``) under
``pp_breakable``: aten-level graphs break where the torch-level graph would, at attention only.

The tracer exports the model (``torch.export``) and splits the aten graph at each ``pipe_split()``; each
stage module holds aten ops (``aten.embedding(weight, indices)``, RoPE's ``x[..., :d]`` as
``aten.slice.Tensor``, ``.to(dtype)`` as ``aten._assert_tensor_metadata`` + ``aten.to.dtype``). Each
stage module is compiled with ``pp_breakable``; the stages run in one process, walked by the pipe's
split graph as its local runner does (it feeds stage 0 ``(positions, input_ids)``: the order of the
stage's placeholders, not the model's arguments), each marking its first call's token dims as
``WireStage`` does in ``test_torch_pipelining.py``. The logits must be the eager model's at 1 token, a
bucket, a bucket + 1, the cap and above it, graphs must serve the bucketed counts, and each stage must
break once per decoder layer: at its attention.
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
from ppcompile.records import BreakKind

pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed"),
              pytest.mark.usefixtures("fresh_dynamo", "one_thread")]

VOCAB, HIDDEN, HEADS, HEAD_DIM, NUM_LAYERS = 61, 32, 4, 8, 4
SIZES = [4, 8, 16]
# Graph segments between breaks are never folded into breaks here: every break the checks make counts.
OPTIONS: dict[str, Any] = {"capture_sizes": SIZES, "graph_mode": "emulate", "fold_graph_ops": 0}
# (tokens, bucket or None for eager), the first call's count marked: a bucket, bucket + 1, 1 token, the
# cap, above the cap
COUNTS: list[tuple[int, int | None]] = [(8, 8), (9, 16), (1, None), (16, 16), (21, None)]


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


class MarkedStage:
    """A compiled stage that marks its first call's token dims (dim 0 of every tensor it gets)."""

    def __init__(self, module: nn.Module) -> None:
        self.compiled = torch.compile(module, backend="pp_breakable", options=OPTIONS)
        self.marked = False

    def __call__(self, *args: Any) -> Any:
        if not self.marked:
            ppcompile.mark_token_dynamic(*args)
            self.marked = True
        return self.compiled(*args)


class StageRunner(torch.fx.Interpreter):
    """Walks the pipe's split graph (stage calls and the picks of their outputs) with each stage
    submodule replaced by its compiled module."""

    def __init__(self, split_gm: torch.fx.GraphModule, stages: dict[str, Callable[..., Any]]) -> None:
        super().__init__(split_gm)
        self.stages = stages

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self.stages[str(target)](*args, **kwargs)


def _traced() -> tuple[Decoder, Any]:
    from torch.distributed.pipelining import pipeline

    torch.manual_seed(0)
    model = Decoder().eval()
    pipe = pipeline(model, mb_args=_batch(SIZES[1]))
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
        name: MarkedStage(module) for name, module in pipe.split_gm.named_children()}
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

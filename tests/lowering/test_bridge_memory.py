"""Bridges that are never live at once share one static buffer (``lowering/bridge_memory.py``).

Each stage here is a chain of graph segments around a break op whose output rows depend on every live
row (``mix_rows``), so a graph that read another bridge's value gives a visibly different answer. Graphs
run in the emulated executor: they read only the memory they captured, as CUDA graphs do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from mixer_stage import mix_rows, register_mixer
from runtime_helpers import symbolic_runtime
from torch import nn

from ppcompile.debug import build_report
from ppcompile.debug.capture import format_bytes
from ppcompile.debug.html import render_html
from ppcompile.debug.table import format_report
from ppcompile.lowering import program
from ppcompile.runtime.stage_runtime import StageRuntime
from ppcompile.runtime.static_buffers import BufferPlan

H = 8
SIZES = [4, 8, 16]
TOKEN_COUNTS = [1, 4, 5, 16, 17]  # one token, a bucket, a bucket + 1, the cap, above the cap

register_mixer("pptest_bm::mixer", lambda x: None)


@torch.library.custom_op("pptest_bm::pick", mutates_args=())
def pick(x: torch.Tensor) -> torch.Tensor:
    """Per row, the index of the largest mixed value: an integer break output."""
    return mix_rows(x).argmax(1)


@pick.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], dtype=torch.long)


def _seeded(module: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return module


class Chain(nn.Module):
    """``layers`` x (graph | mixer break): each bridge is read only by the graph right after it."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(H, H) for _ in range(layers))
        _seeded(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.lins:
            x = x + torch.ops.pptest_bm.mixer(torch.relu(lin(x)))
        return x * 2


class LongLived(nn.Module):
    """The first break's output is read again after the second break's is written: both live at once."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, H)
        _seeded(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = torch.ops.pptest_bm.mixer(torch.relu(self.a(x)))
        second = torch.ops.pptest_bm.mixer(torch.relu(self.b(first)))
        return self.c(first) * 3 + second


class Picks(nn.Module):
    """Two layers whose break outputs are row indices that the next graph looks up."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(H, H) for _ in range(2))
        self.table = nn.Embedding(H, H)
        _seeded(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.lins:
            x = x + self.table(torch.ops.pptest_bm.pick(lin(x)))
        return x


@pytest.fixture(autouse=True)
def _fresh(fresh_dynamo: None) -> Iterator[None]:
    with torch.no_grad():
        yield


def _compile(m: nn.Module) -> Any:
    options = {"capture_sizes": SIZES, "split_ops": ["pptest_bm::mixer", "pptest_bm::pick"],
               "graph_mode": "emulate"}
    return torch.compile(m, backend="pp_breakable", dynamic=True, fullgraph=True, options=options)


def _check_against_eager(compiled: Any, m: nn.Module) -> None:
    for i, n in enumerate(TOKEN_COUNTS):
        x = torch.randn(n, H, generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(compiled(x), m(x))


def _owners(rt: StageRuntime) -> list[int | None]:
    return [p.shares_with for p in rt.program.buffers.values() if p.role == "bridge"]


def test_bridges_of_a_chain_of_layers_share_one_buffer_and_match_eager() -> None:
    m = Chain(4)
    _check_against_eager(_compile(m), m)
    rt = symbolic_runtime(m)
    first = next(iter(rt.program.bridge_buffers))
    assert _owners(rt) == [None, first, first, first]
    (instance,) = rt.instances()
    assert len({b.data_ptr() for b in instance.bridge_buffers.values()}) == 1
    report = build_report(rt)
    bridges = [b for b in report["static_buffers"] if b["role"] == "bridge"]
    assert [b["shares_memory_with"] for b in bridges] == [None, *[bridges[0]["name"]] * 3]
    one_bridge = bridges[0]["bytes"]
    inputs = sum(b["bytes"] for b in report["static_buffers"] if b["role"] == "input")
    assert report["memory"]["static_buffer_bytes"] == inputs + one_bridge
    assert format_report(report).count(f"in {bridges[0]['name']}'s") == 3  # the text report's bytes column
    page = render_html(report)
    assert page.count(f"in {bridges[0]['name']}&#x27;s") == 3
    card = f"<div class='v'>{format_bytes(inputs + one_bridge)}</div><div class='k'>"
    assert f"{card}{len(report['static_buffers'])} static buffers</div>" in page  # shared memory once


def test_bridges_live_at_once_keep_their_own_buffers() -> None:
    m = LongLived()
    _check_against_eager(_compile(m), m)
    rt = symbolic_runtime(m)
    assert _owners(rt) == [None, None]
    (instance,) = rt.instances()
    assert len({b.data_ptr() for b in instance.bridge_buffers.values()}) == 2


def test_sharing_the_buffer_of_a_bridge_still_live_gives_wrong_answers_under_emulation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The teeth of the test above: the same stage with its second bridge planned into the first's
    buffer overwrites a value a later graph still reads."""

    def share_all(buffers: Mapping[int, BufferPlan], steps: Any) -> dict[int, BufferPlan]:
        first, *others = [s for s, p in buffers.items() if p.role == "bridge"]
        return {**buffers, **{s: dataclasses.replace(buffers[s], shares_with=first) for s in others}}

    monkeypatch.setattr(program, "share_bridge_memory", share_all)
    m = LongLived()
    compiled = _compile(m)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(compiled(x), m(x))
    assert _owners(symbolic_runtime(m))[1] is not None


def test_integer_bridges_keep_their_own_buffers() -> None:
    """Capture runs graphs on whatever a buffer holds; an index another bridge wrote could be out of range
    for this one's readers, so only floating-point bridges share."""
    m = Picks()
    _check_against_eager(_compile(m), m)
    rt = symbolic_runtime(m)
    assert [b.dtype for b in rt.program.bridge_buffers.values()] == [torch.long, torch.long]
    assert _owners(rt) == [None, None]

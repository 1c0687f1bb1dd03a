"""Declared token-local regions (``ppcompile.token_local``): found by class and by instance, graphed as a
whole, never cut, and equal to eager at token counts that are not a bucket."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from fx_helpers import dynamo_graph, make_ctx, run_until
from torch import nn

import ppcompile
from ppcompile.analysis import partitions
from ppcompile.analysis.node_facts import PADDING_UNSAFE, TOKEN_LOCAL
from ppcompile.passes.check_padding_safety import check_padding_safety
from ppcompile.passes.find_declared_regions import find_declared_regions
from ppcompile.records import BreakKind
from ppcompile.tracing import regions
from ppcompile.tracing.regions import is_declared, undeclare

H = 8
CAPTURE = [8, 16]
OPTIONS = {"capture_sizes": CAPTURE, "graph_mode": "emulate"}


class TinyMoe(nn.Module):
    """Top-1 routing by sorting tokens by expert and running each expert on its group, as HF's grouped
    experts do: sort, histc and index_copy mix rows op by op; the block as a whole is token-local."""

    def __init__(self, experts: int = 3) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.router = nn.Parameter(torch.randn(H, experts, generator=g))
        self.weights = nn.Parameter(torch.randn(experts, H, H, generator=g) / H**0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        expert = (h @ self.router).argmax(-1)
        order = torch.sort(expert, stable=True).indices
        counts = torch.histc(expert.float(), bins=self.weights.shape[0], min=0, max=self.weights.shape[0] - 1)
        grouped = torch.bmm(h[order].unsqueeze(1), self.weights[expert[order]]).squeeze(1)
        out = torch.zeros_like(h).index_copy(0, order, grouped)
        return out * (1 + 0 * counts.sum())  # keep histc in the graph


class Stage(nn.Module):
    def __init__(self, moe: nn.Module | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(H, H)
        self.moe = moe if moe is not None else TinyMoe()
        self.out = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.moe(self.inp(x))))


@pytest.fixture(autouse=True)
def _undeclare() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    undeclare(TinyMoe)
    torch._dynamo.reset()


def _run(stage: nn.Module, counts: tuple[int, ...] = (5, 8, 11, 16, 20), **options: Any) -> Any:
    compiled = torch.compile(stage, backend="pp_breakable", options={**OPTIONS, **options})
    with torch.no_grad():
        for i, n in enumerate(counts):
            x = torch.randn(n, H)
            if i == 0:
                ppcompile.mark_token_dynamic(x)
            torch.testing.assert_close(compiled(x), stage(x), msg=lambda m, n=n: f"{n} tokens: {m}")
    return ppcompile.stage_runtimes()[-1]


def _regions(stage: nn.Module) -> dict[str, str]:
    """Op name -> "region|unsafe reason" for each call (the last call of an op wins)."""
    gm, ex = dynamo_graph(stage, torch.randn(6, H))
    ctx = make_ctx(gm, ex)
    gm = run_until(gm, ctx, check_padding_safety)
    return {str(getattr(n.target, "__name__", n.target)): (TOKEN_LOCAL.get(n) or "") + "|"
            + (PADDING_UNSAFE.get(n) or "")
            for n in gm.graph.nodes if n.op in ("call_function", "call_method")}


@pytest.mark.parametrize("how", ["class", "instance"])
def test_declared_nodes_are_one_region_and_skip_the_op_rules(how: str) -> None:
    stage = Stage()
    ppcompile.token_local(TinyMoe if how == "class" else stage.moe)
    assert is_declared(stage.moe)
    marks = _regions(stage)
    inside = {k: v for k, v in marks.items() if v.startswith("moe (")}
    assert any(k.startswith("sort") for k in inside) and any(k.startswith("histc") for k in inside), marks
    assert all(v.endswith("|") for v in inside.values()), inside  # no pp_unsafe inside
    assert marks["linear"] == "|" and marks["relu"] == "|", marks


def test_undeclared_block_breaks_at_its_row_mixing_ops() -> None:
    marks = _regions(Stage())
    unsafe = [k for k, v in marks.items() if v.split("|")[1]]
    assert any(k.startswith("sort") for k in unsafe) and any(k.startswith("histc") for k in unsafe), marks


@pytest.mark.parametrize("how", ["class", "instance"])
def test_a_declared_block_is_graphed_and_matches_eager_off_buckets(how: str) -> None:
    """Padded rows are routed too, but only their own rows receive the results: equal to eager at
    counts that are not a bucket (5, 11, 20 above the cap), on the emulation and the static buffers."""
    stage = Stage()
    ppcompile.token_local(TinyMoe if how == "class" else stage.moe)
    for graph_mode in ("emulate", "eager"):
        torch._dynamo.reset()
        runtime = _run(stage, graph_mode=graph_mode)
        assert [s.kind for s in runtime.segments] == ["graph"], runtime.describe()
        assert runtime.segments[0].token_local_regions == (f"moe ({TinyMoe.__module__}.TinyMoe)",)
    assert ppcompile.counters.replays == 8  # 5, 8, 11, 16 on both modes; 20 is above the cap


def test_the_report_names_the_declared_regions(tmp_path: Any) -> None:
    import json

    ppcompile.token_local(TinyMoe)
    runtime = _run(Stage(), counts=(5,), dump_dir=str(tmp_path))
    (report,) = tmp_path.glob("*/report.json")
    data = json.loads(report.read_text())
    name = f"moe ({TinyMoe.__module__}.TinyMoe)"
    assert data["token_local_regions"] == [name]
    assert data["segments"][0]["token_local_regions"] == [name]
    assert "token-local: " + name in runtime.describe()


class SortedRowwise(nn.Module):
    """Sorts tokens by a feature, applies a row-wise user split op to the sorted rows, unsorts: token-local
    as a whole, but its inner values are not token-major."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        order = torch.argsort(h[:, 0])
        y = torch.ops.pptest.mix(h[order])
        return torch.zeros_like(y).index_copy(0, order, y)


def _sorted_stage() -> Stage:
    return Stage(SortedRowwise())


def test_a_region_with_a_break_inside_is_one_break() -> None:
    ppcompile.token_local(SortedRowwise)
    try:
        runtime = _run(_sorted_stage(), split_ops=["pptest::mix"])
    finally:
        undeclare(SortedRowwise)
    breaks = [r for r in runtime.break_reasons if r.kind is BreakKind.USER_SPLIT_OP]
    assert len(breaks) == 1 and breaks[0].op.startswith("moe ("), runtime.describe()
    assert "argsort" in breaks[0].op and "index_copy" in breaks[0].op


def test_without_keeping_regions_whole_the_break_reads_the_wrong_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rule has teeth: cut inside the region, the break sees the first ``n`` of the bucket's sorted
    rows, which mix padded rows in among live ones."""
    ppcompile.token_local(SortedRowwise)
    monkeypatch.setattr(partitions, "uncuttable_spans", lambda gm: [])
    try:
        with pytest.raises(AssertionError, match="5 tokens: Tensor-likes are not close"):
            _run(_sorted_stage(), counts=(8, 5), split_ops=["pptest::mix"])
    finally:
        undeclare(SortedRowwise)


def test_a_wrong_declaration_gives_wrong_answers_off_buckets() -> None:
    """What the contract guards against: a block that mixes rows (here a mean over tokens, standing for
    expert capacity or statistics kept across tokens), declared token-local, sees padded rows."""

    class Centering(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h - h.mean(0, keepdim=True)

    stage = Stage(ppcompile.token_local(Centering()))
    with pytest.raises(AssertionError, match="5 tokens: Tensor-likes are not close"):
        _run(stage, counts=(8, 5))


def test_bad_declarations_raise() -> None:
    with pytest.raises(TypeError, match=r"nn\.Module"):
        ppcompile.token_local(int)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"nn\.Module"):
        ppcompile.token_local(lambda x: x)  # type: ignore[arg-type]


def test_declaring_twice_wraps_once() -> None:
    moe = TinyMoe()
    first: Callable[..., Any] = ppcompile.token_local(moe).forward
    assert ppcompile.token_local(moe).forward is first
    undeclare(moe)
    assert not is_declared(moe)


def test_region_pass_runs_before_the_padding_check() -> None:
    from ppcompile.passes.manager import PASSES

    names = [p.__name__ for p in PASSES]
    assert names.index(find_declared_regions.__name__) < names.index(check_padding_safety.__name__)


def chunked_cumsum(h: torch.Tensor, chunk: int = 4) -> torch.Tensor:
    """Pads the tokens to a multiple of ``chunk``, scans each chunk, unpads: row-mixing all through."""
    pad = (chunk - h.shape[0] % chunk) % chunk
    padded = torch.nn.functional.pad(h, (0, 0, 0, pad))
    scanned = padded.view(-1, chunk, h.shape[1]).flip(1).cumsum(1).flip(1)
    return (scanned.reshape(-1, h.shape[1]) * 0.5 + 1)[: h.shape[0]]


class Chunked(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return chunked_cumsum(h)


def test_an_eager_region_is_one_break_and_matches_eager() -> None:
    ppcompile.eager_region(chunked_cumsum)
    try:
        runtime = _run(Stage(Chunked()), fold_graph_ops=0)
    finally:
        undeclare(chunked_cumsum)
    assert [s.kind for s in runtime.segments] == ["graph", "break", "graph"], runtime.describe()
    (reason,) = runtime.break_reasons
    assert reason.kind is BreakKind.EAGER_REGION and "chunked_cumsum" in reason.op
    assert "pad" in reason.op and "flip" in reason.op


def test_without_the_declaration_the_scan_breaks_op_by_op() -> None:
    runtime = _run(Stage(Chunked()), fold_graph_ops=0)
    assert sum(not s.is_graph for s in runtime.segments) > 1, runtime.describe()
    assert all(r.kind is not BreakKind.EAGER_REGION for r in runtime.break_reasons)


def test_eager_region_takes_python_functions_only() -> None:
    with pytest.raises(TypeError, match="Python function"):
        ppcompile.eager_region(torch.relu)


def test_library_regions_are_known_once_their_module_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF's mask builders form one library region when transformers.masking_utils is loaded (nothing is
    imported for it), under one label, which is not a break by itself."""
    module = types.ModuleType("transformers.masking_utils")

    def create_causal_mask() -> None: ...

    def create_sliding_window_causal_mask() -> None: ...

    module.create_causal_mask = create_causal_mask  # type: ignore[attr-defined]
    module.create_sliding_window_causal_mask = create_sliding_window_causal_mask  # type: ignore[attr-defined]
    monkeypatch.delitem(sys.modules, "transformers.masking_utils", raising=False)
    assert not any(regions.is_library_label(label) for label in regions.declared_functions().values())
    monkeypatch.setitem(sys.modules, "transformers.masking_utils", module)
    found = regions.library_functions()
    label = "library region: transformers attention masks (masking_utils)"
    assert found == {(__file__, "create_causal_mask"): label,
                     (__file__, "create_sliding_window_causal_mask"): label}
    assert regions.is_library_label(label) and regions.declared_functions().items() >= found.items()

"""Tests of the pass manager: order, timing, dumps, and how a failing pass is reported."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from attention_modules import Attn, attention_context
from fx_helpers import bridges, dynamo_graph, make_ctx

from ppcompile.analysis.node_facts import segments
from ppcompile.passes.context import PassContext, PassResult
from ppcompile.passes.manager import PASSES, PassError, run_passes
from ppcompile.torch_internals import restart_analysis

PASS_NAMES = ["find_token_dims", "align_global_layers", "split_at_breaks", "lift_static_inputs"]


def _graph():  # type: ignore[no-untyped-def]
    with attention_context(6, (0, 1)):
        return dynamo_graph(Attn((0, 1)), torch.randn(6, 8))


def test_passes_run_in_the_documented_order() -> None:
    names = [p.__name__ for p in PASSES]
    assert [n for n in names if n in PASS_NAMES] == PASS_NAMES  # other passes may sit between these
    assert len(set(names)) == len(names)


def test_run_passes_fills_every_fact_and_times_every_pass() -> None:
    gm, ex = _graph()
    ctx = make_ctx(gm, ex, capture_sizes=[16], dump_dir=None)
    split = run_passes(gm, ctx)
    assert list(ctx.pass_times) == [p.__name__ for p in PASSES]
    assert all(t >= 0.0 for t in ctx.pass_times.values())
    assert ctx.token_symbol is not None and ctx.layer_ids == (0, 1)
    assert len(segments(split)) == 5 and len(ctx.static_inputs) == 1 and len(bridges(split)) == 2
    assert split is not gm and len(list(split.graph.find_nodes(op="call_module"))) == 5


def test_dumps_only_modified_graphs_with_ordered_names(tmp_path: Path) -> None:
    gm, ex = _graph()
    ctx = make_ctx(gm, ex, capture_sizes=[16], dump_dir=str(tmp_path))
    ctx.graph_name = "stage_1"
    run_passes(gm, ctx)
    folder = tmp_path / "stage_1"
    names = [p.__name__ for p in PASSES]
    files = sorted(os.listdir(folder))
    split_file = f"{names.index('split_at_breaks') + 1:02d}.split_at_breaks.py"
    assert files[0] == "00.dynamo_graph.py" and split_file in files
    for f in files[1:]:  # NN.<pass>.py, NN the pass's place in PASSES
        index, name, _ = f.split(".")
        assert names[int(index) - 1] == name
        assert name not in {"find_token_dims", "align_global_layers", "lift_static_inputs"}  # record facts
    for f in folder.iterdir():
        text = f.read_text()
        compile(text, str(f), "exec")  # a readable, syntactically valid Python file
        assert "stage_1" in text.splitlines()[0]
    assert "submod_1" in (folder / split_file).read_text()
    assert "ppcompile.attention" in (folder / "00.dynamo_graph.py").read_text()


def test_no_dump_without_dump_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PPCOMPILE_DUMP_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    gm, ex = _graph()
    ctx = make_ctx(gm, ex, capture_sizes=[16])
    assert ctx.config.dump_dir is None
    run_passes(gm, ctx)
    assert list(tmp_path.iterdir()) == []


def _boom(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    raise KeyError("no such node")


def _bad_value(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    raise ValueError("a user error with its own message")


def test_failing_pass_is_reported_by_name(tmp_path: Path) -> None:
    gm, ex = _graph()
    ctx = make_ctx(gm, ex, dump_dir=str(tmp_path))
    ctx.graph_name = "stage_x"
    with pytest.raises(PassError, match=r"pass '_boom' failed on stage_x: KeyError") as info:
        run_passes(gm, ctx, passes=(PASSES[0], _boom, *PASSES[1:]))
    assert isinstance(info.value.__cause__, KeyError)
    assert str(tmp_path) in str(info.value)
    assert list(ctx.pass_times) == [PASSES[0].__name__]


def _restart(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    raise restart_analysis()()


def test_dynamo_restart_passes_through_unwrapped() -> None:
    """A pass may ask Dynamo to re-trace (``tensorify_float_attributes``): that is no failure."""
    gm, ex = _graph()
    with pytest.raises(restart_analysis()) as info:
        run_passes(gm, make_ctx(gm, ex), passes=(_restart,))
    assert not isinstance(info.value, PassError)


def test_value_error_passes_through_unwrapped() -> None:
    gm, ex = _graph()
    with pytest.raises(ValueError, match="a user error with its own message"):
        run_passes(gm, make_ctx(gm, ex), passes=(_bad_value,))


def test_duplicate_layer_ids_reach_the_caller_as_value_error() -> None:
    with attention_context(6, (3,)):
        gm, ex = dynamo_graph(Attn((3, 3)), torch.randn(6, 8))
    with pytest.raises(ValueError, match="global layer id 3"):
        run_passes(gm, make_ctx(gm, ex))

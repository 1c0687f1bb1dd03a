"""Dumps: ordered runnable files per stage graph, the split module and each segment, rank folders, and the
same text through ``torch._logging.trace_structured``."""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import logging
import os
import runpy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from debug_helpers import compile_stage
from torch.fx.experimental.proxy_tensor import make_fx

from ppcompile.observe.runnable import not_runnable_reason, runnable_source
from ppcompile.passes.manager import PASSES


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_stage_dump_layout(tmp_path: Path) -> None:
    stage = compile_stage({"dump_dir": str(tmp_path)})
    stage.call(10)
    rt = stage.runtime
    folder = tmp_path / rt.name
    assert [p.name for p in tmp_path.iterdir()] == [rt.name]
    files = _files(folder)
    names = [p.__name__ for p in PASSES]
    passes = [f for f in files if f[:2].isdigit()]
    assert passes[0] == "00.dynamo_graph.py"
    for f in passes[1:]:  # NN.<pass>.py, NN its place in PASSES, only for passes that changed the graph
        index, name, _ = f.split(".")
        assert names[int(index) - 1] == name
    assert f"{names.index('split_at_breaks') + 1:02d}.split_at_breaks.py" in passes
    segments = [f"segments/{i:02d}.{s.name}.{s.kind}.py" for i, s in enumerate(rt.segments)]
    assert [f for f in files if f.startswith("segments/")] == segments
    assert {"split_module.py", "runtime_code.txt", "report.json", "report.html"} <= set(files)
    code = (folder / "runtime_code.txt").read_text()
    assert "def live_forward(args, env):" in code and "def bind_graph_forward(" in code
    assert "def graph_forward(args, env_n, n):" in code  # what a call runs, bound once per bucket
    for i, seg in enumerate(rt.segments):  # each segment called once per path: a replay or a call
        assert code.count(f"replay_{i}(" if seg.is_graph else f"call_{i}(") == (1 if seg.is_graph else 2)
    assert len(rt.segments) == 3 and [s.kind for s in rt.segments] == ["graph", "break", "graph"]
    for f in files:
        if f.endswith(".py"):
            text = (folder / f).read_text()
            compile(text, f, "exec")
            assert text.startswith("# ppcompile: ") and rt.name in text.splitlines()[0]


def test_segment_dump_runs_and_matches_the_segment(tmp_path: Path) -> None:
    """A graph segment's file runs as a script, and computes what the compiled segment computes."""
    stage = compile_stage({"dump_dir": str(tmp_path)})
    stage.call(10)
    rt = stage.runtime
    path = tmp_path / rt.name / "segments" / f"02.{rt.segments[2].name}.graph.py"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(str(path), run_name="__main__")
    assert out.getvalue().splitlines()[0].startswith("0 (")  # "index shape dtype" per output
    ns = runpy.run_path(str(path))
    (sym,) = inspect.signature(ns["example_inputs"]).parameters  # the token count's symbol
    inputs = ns["example_inputs"](**{sym: 12})
    assert any(isinstance(x, torch.Tensor) and x.shape[0] == 12 for x in inputs)
    want = rt.split_module.get_submodule(rt.segments[2].name)(*inputs)
    got = ns["make_module"]()(*inputs)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_split_module_dump_runs_in_a_made_up_forward_context(tmp_path: Path) -> None:
    """The split module calls the reference attention, which reads a forward context: its harness makes
    one up from the traced keys (one sequence, zeroed KV caches of the stage's layers) and runs in it."""
    stage = compile_stage({"dump_dir": str(tmp_path)})
    stage.call(10)
    rt = stage.runtime
    path = tmp_path / rt.name / "split_module.py"
    text = path.read_text()
    assert "import ppcompile.models.attention  # registers ppcompile::attention" in text
    assert not_runnable_reason(text) is None and "made-up forward context" in text.splitlines()[1]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(str(path), run_name="__main__")
    assert out.getvalue().splitlines()[0].startswith("0 (")
    ns = runpy.run_path(str(path))
    (sym,) = inspect.signature(ns["forward_context"]).parameters
    inputs = ns["example_inputs"](**{sym: 12})
    with torch.no_grad(), ns["forward_context"](**{sym: 12}) as ctx:
        got = ns["make_module"]()(*inputs)
        want = rt.split_module(*inputs)
    assert sorted(ctx.kv_caches) == list(rt.layer_ids) and ctx.seq_lens == [12]
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@torch.library.custom_op("dumptest::engine_attention", mutates_args=())
def _engine_attention(q: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("reads an engine's forward context")


@_engine_attention.register_fake
def _(q: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


def test_a_graph_calling_engine_state_ops_says_it_does_not_run(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine's attention op (engine_ops.py) reads a context no dump can make up: the file says so in
    its header and, run as a script, prints why and exits 0 instead of a traceback."""
    from ppcompile.engine_ops import EngineOp, OpRole
    from ppcompile.observe import runnable

    entry = EngineOp(OpRole.ATTENTION, "vLLM", layer_arg="layer_name")
    monkeypatch.setattr(runnable, "engine_op", lambda name: entry if name == "dumptest::engine_attention"
                        else None)
    def engine_graph(q: torch.Tensor) -> torch.Tensor:
        return torch.ops.dumptest.engine_attention(q) + 1

    traced = make_fx(engine_graph, tracing_mode="fake")(torch.rand(4, 2))
    traced.graph.output_node().type = None  # make_fx keeps the (string) return annotation: not Dynamo's way
    gm = torch.fx.GraphModule(torch.nn.Module(), traced.graph)  # named GraphModule, as Dynamo's graphs are
    text = runnable.runnable_source(gm, "engine graph")
    why = not_runnable_reason(text)
    assert why is not None and "dumptest::engine_attention reads vLLM's forward context" in why
    path = tmp_path / "engine_graph.py"
    path.write_text(text)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        runpy.run_path(str(path), run_name="__main__")
    assert exited.value.code == 0 and out.getvalue() == f"not run: {why}\n"
    ns = runpy.run_path(str(path))  # imported, the harness is there to call inside the engine's forward
    assert [x.shape for x in ns["example_inputs"]()] == [(4, 2)] and callable(ns["make_module"])


def test_a_graph_without_traced_values_has_no_harness_and_says_so() -> None:
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    text = runnable_source(gm, "traced without values")
    assert (not_runnable_reason(text) or "").startswith("no harness")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        exec(compile(text, "traced.py", "exec"), {"__name__": "__main__"})
    assert exited.value.code == 0 and out.getvalue().startswith("not run: no harness")


def test_stale_dumps_of_the_same_graph_are_removed(tmp_path: Path) -> None:
    folder = tmp_path / "stage_graph_0_0"
    (folder / "segments").mkdir(parents=True)
    for name in ("07.old_pass.py", "segments/09.submod_9.graph.py", "notes.txt"):
        (folder / name).write_text("old")
    stage = compile_stage({"dump_dir": str(tmp_path)})
    stage.call(10)
    assert stage.runtime.name == "stage_graph_0_0"
    files = _files(folder)
    assert "07.old_pass.py" not in files and "segments/09.submod_9.graph.py" not in files
    assert "notes.txt" in files  # only what ppcompile writes is removed


def test_env_var_sets_the_dump_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPCOMPILE_DUMP_DIR", str(tmp_path))
    stage = compile_stage({})
    stage.call(10)
    assert (tmp_path / stage.runtime.name / "report.json").is_file()


def test_no_files_without_dump_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PPCOMPILE_DUMP_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    stage = compile_stage({})
    stage.call(10)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def _gloo_world_of_one(tmp_path: Path) -> Iterator[None]:
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("_gloo_world_of_one")
def test_rank_subfolder_and_report_rank_under_torch_distributed(tmp_path: Path) -> None:
    dumps = tmp_path / "dumps"
    stage = compile_stage({"dump_dir": str(dumps)})
    stage.call(10)
    folder = dumps / "rank_0" / stage.runtime.name
    assert (folder / "00.dynamo_graph.py").is_file() and (folder / "report.json").is_file()
    assert [p.name for p in dumps.iterdir()] == ["rank_0"]
    assert json.loads((folder / "report.json").read_text())["rank"] == 0  # the same rank in the report


class _Artifacts(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.items: dict[str, Any] = {}

    def emit(self, record: logging.LogRecord) -> None:
        meta = getattr(record, "metadata", {})
        if "artifact" in meta and meta["artifact"]["name"].startswith("ppcompile_"):
            self.items[meta["artifact"]["name"]] = getattr(record, "payload", None)


@pytest.fixture
def artifacts() -> Iterator[_Artifacts]:
    trace_log = torch._logging._internal.trace_log
    handler = _Artifacts()
    trace_log.addHandler(handler)
    try:
        yield handler
    finally:
        trace_log.removeHandler(handler)


def test_trace_structured_artifacts_match_the_files(tmp_path: Path, artifacts: _Artifacts) -> None:
    stage = compile_stage({"dump_dir": str(tmp_path)})
    stage.call(10)
    folder = tmp_path / stage.runtime.name
    items = artifacts.items
    for f in _files(folder):
        if f.endswith(".py"):
            name = "ppcompile_" + f.removesuffix(".py").replace("/", "_").replace(".", "_")
            assert items.get(name) == (folder / f).read_text(), name
    assert "ppcompile_report" in items and '"schema"' in items["ppcompile_report"]


def test_trace_structured_without_dump_dir(tmp_path: Path, artifacts: _Artifacts,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PPCOMPILE_DUMP_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    stage = compile_stage({})
    stage.call(10)
    assert {"ppcompile_00_dynamo_graph", "ppcompile_split_module", "ppcompile_report"} <= set(artifacts.items)
    assert os.listdir(tmp_path) == []

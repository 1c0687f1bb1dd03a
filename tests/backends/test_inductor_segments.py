"""``segment_compiler="inductor"`` on reference stages: equal to eager at every token count, one compile
per distinct segment serving every bucket, artifacts shared by identical layers and across stages."""

from __future__ import annotations

import re

import pytest
import torch
from fx_helpers import scaler
from stage_helpers import check, graphed_runtime, run

import ppcompile
from ppcompile.backends import segment_compilers
from ppcompile.backends.segment_compilers import SEGMENT_INDUCTOR_DEFAULTS
from ppcompile.models import REFERENCE_CONFIGS, make_stage

PP = 4
CFG = REFERENCE_CONFIGS["small-dense"].replace(num_layers=12)  # 3 layers a stage: 4 graph segments
SIZES = [4, 8, 16, 32, 64]
OPTIONS = {"segment_compiler": "inductor", "capture_sizes": SIZES, "graph_mode": "emulate"}  # graph path
GRAPH_SEGMENTS = 4  # before layer 1's attention, between attentions (x2), after the last one
UNIQUE = 3  # first, middle, last


def test_every_token_count_matches_eager_with_one_compile_per_distinct_segment() -> None:
    stage = make_stage(CFG, 1, PP)
    compiled = torch.compile(stage, backend="pp_breakable", dynamic=True, options=OPTIONS)
    c = ppcompile.counters
    with c.expect(backend_compiles=1, segment_compiles=UNIQUE, segment_cache_hits=GRAPH_SEGMENTS - UNIQUE,
                  replays_by_bucket={16: 1}):
        check(stage, compiled, CFG, 1, PP, 16)  # a bucket exactly
    runtime = graphed_runtime()
    records = runtime.compiled.record.segment_compiles
    assert [r.reused for r in records] == [False, False, True, False]
    assert records[1].key == records[2].key and len({r.key for r in records}) == UNIQUE
    assert all(r.seconds > 0 for r in records if not r.reused)
    times = runtime.compiled.record.compile_times
    assert times["segment_compile"] == sum(r.seconds for r in records) > 0
    assert {"passes", "pass.split_at_breaks"} <= set(times)
    # Every other bucket, bucket + 1 and above the cap: no new compile of any kind.
    with c.expect(backend_compiles=0, segment_compiles=0, replays_by_bucket={4: 1, 8: 1, 32: 2, 64: 1},
                  eager_runs=1):
        for n in (3, 8, 17, 32, 64, 70):
            check(stage, compiled, CFG, 1, PP, n)
    # One token: Dynamo specialises the token dim to 1, a static graph that runs eagerly.
    with c.expect(segment_compiles=0, eager_runs=1, replays=0):
        check(stage, compiled, CFG, 1, PP, 1)


def test_graph_mode_none_runs_the_compiled_segments_at_live_size() -> None:
    """No graphs, buckets or static buffers: the Inductor segments themselves serve every count."""
    stage = make_stage(CFG, 1, PP)
    options = {**OPTIONS, "graph_mode": "none"}
    compiled = torch.compile(stage, backend="pp_breakable", dynamic=True, options=options)
    c = ppcompile.counters
    with c.expect(segment_compiles=UNIQUE, replays=0, captures=0, eager_runs=1):
        check(stage, compiled, CFG, 1, PP, 16)
    runtime = graphed_runtime(allow_graphless=True)
    assert runtime.graph_mode == "none" and runtime.instances() == ()
    with c.expect(backend_compiles=0, segment_compiles=0, replays=0, captures=0, eager_runs=3):
        for n in (17, 64, 70):  # a bucket + 1, the cap, above the cap
            check(stage, compiled, CFG, 1, PP, n)


def test_inductor_config_reaches_every_segment_compile_and_keys_the_sharing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch._inductor.compile_fx as compile_fx_module

    real = compile_fx_module.compile_fx
    seen: list[object] = []
    depth = [0]

    def recording(gm: torch.fx.GraphModule, inputs: list[object], **kwargs: object) -> object:
        if depth[0] == 0:  # compile_fx calls itself again once the patches are applied
            seen.append(kwargs.get("config_patches"))
        depth[0] += 1
        try:
            return real(gm, inputs, **kwargs)
        finally:
            depth[0] -= 1

    monkeypatch.setattr(compile_fx_module, "compile_fx", recording)
    patched = {**OPTIONS, "inductor_config": {"size_asserts": True, "epilogue_fusion": False}}
    stages = [make_stage(CFG, 1, PP) for _ in range(2)]
    with ppcompile.counters.expect(segment_compiles=UNIQUE):
        check(stages[0], torch.compile(stages[0], backend="pp_breakable", dynamic=True, options=patched),
              CFG, 1, PP, 16)
    assert seen == [{"size_asserts": True, "epilogue_fusion": False}] * UNIQUE
    patched_keys = [r.key for r in graphed_runtime().compiled.record.segment_compiles]
    # Other settings are other artifacts: nothing is shared with the patched compiles.
    with ppcompile.counters.expect(segment_compiles=UNIQUE):
        check(stages[1], torch.compile(stages[1], backend="pp_breakable", dynamic=True, options=OPTIONS),
              CFG, 1, PP, 16)
    assert seen[UNIQUE:] == [dict(SEGMENT_INDUCTOR_DEFAULTS)] * UNIQUE  # ppcompile's own defaults
    plain_keys = [r.key for r in graphed_runtime().compiled.record.segment_compiles]
    assert not set(patched_keys) & set(plain_keys)


def test_identical_stages_share_artifacts_and_bind_their_own_weights() -> None:
    stages = [make_stage(CFG, rank, PP) for rank in (1, 2)]
    compiled = [torch.compile(s, backend="pp_breakable", dynamic=True, options=OPTIONS) for s in stages]
    c = ppcompile.counters
    with c.expect(segment_compiles=UNIQUE):
        check(stages[0], compiled[0], CFG, 1, PP, 24)
    first = graphed_runtime().compiled.record.segment_compiles
    with c.expect(backend_compiles=1, segment_compiles=0, segment_cache_hits=GRAPH_SEGMENTS):
        check(stages[1], compiled[1], CFG, 2, PP, 24)
    second = graphed_runtime().compiled.record.segment_compiles
    assert [r.key for r in first] == [r.key for r in second]
    assert all(r.reused and r.seconds == 0 for r in second)
    for n in (5, 64):  # both stages still right after each other's calls
        check(stages[0], compiled[0], CFG, 1, PP, n)
        check(stages[1], compiled[1], CFG, 2, PP, n)


def test_dedup_off_compiles_every_graph_segment() -> None:
    stage = make_stage(CFG, 1, PP)
    options = {**OPTIONS, "dedup_segments": False}
    compiled = torch.compile(stage, backend="pp_breakable", dynamic=True, options=options)
    with ppcompile.counters.expect(segment_compiles=GRAPH_SEGMENTS, segment_cache_hits=0):
        check(stage, compiled, CFG, 1, PP, 16)
    records = graphed_runtime().compiled.record.segment_compiles
    assert not any(r.reused for r in records)
    assert records[1].key == records[2].key  # the same structure, compiled twice on request


def test_a_failing_segment_compile_names_the_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(gm: torch.fx.GraphModule, patches: object = None) -> None:
        raise NotImplementedError("no lowering for this op")

    monkeypatch.setattr(segment_compilers, "_compile_symbolic", fail)
    stage = make_stage(CFG, 1, PP)
    compiled = torch.compile(stage, backend="pp_breakable", dynamic=True, fullgraph=True, options=OPTIONS)
    with pytest.raises(Exception, match=r"inductor failed to compile graph segment submod_0 of "
                                        r"stage_graph_\S+ \(key [0-9a-f]{16}\): NotImplementedError: "
                                        r"no lowering for this op\. Set options=\{'segment_compiler'"):
        run(stage, compiled, CFG, 1, PP, 16)


def test_an_artifact_whose_compile_added_guards_stays_in_its_stage_graph(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inductor's shape guards are installed for the Dynamo graph that compiled: pretend every compile
    added one, and the artifacts are shared within that graph only."""
    calls = iter(range(10**6))
    monkeypatch.setattr(segment_compilers, "_shape_facts", lambda env: (next(calls), 0, 0))
    stages = [make_stage(CFG, rank, PP) for rank in (1, 2)]
    compiled = [torch.compile(s, backend="pp_breakable", dynamic=True, options=OPTIONS) for s in stages]
    for rank, stage, comp in zip((1, 2), stages, compiled):
        with ppcompile.counters.expect(segment_compiles=UNIQUE, segment_cache_hits=GRAPH_SEGMENTS - UNIQUE):
            check(stage, comp, CFG, rank, PP, 16)


def test_segment_compile_reports_progress(caplog: pytest.LogCaptureFixture) -> None:
    """Long compiles say what they did: one progress line per stage graph (no terminal: a log line)."""
    stage = make_stage(CFG, 1, PP)
    compiled = torch.compile(stage, backend="pp_breakable", dynamic=True, options=OPTIONS)
    with caplog.at_level("INFO", logger="ppcompile"):
        check(stage, compiled, CFG, 1, PP, 16)
    pattern = re.compile(r"segment compile .*: (\d+) compiled, (\d+) reused")
    found = [pattern.search(r.getMessage()) for r in caplog.records]
    counts = [(int(m[1]), int(m[2])) for m in found if m]
    # One line per backend call (Dynamo may call it again after a restart); the cache is process-wide.
    assert counts and all(compiled + reused == GRAPH_SEGMENTS for compiled, reused in counts), counts


class _ScaledSteps(torch.nn.Module):
    """Three linears, each followed by its own closure of one scaling function (declared token-local),
    with a break (``sin``, a split op) between: the second and third graph segments differ only in the
    closure they call."""

    def __init__(self) -> None:
        super().__init__()
        self.linears = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.scales = [torch._dynamo.allow_in_graph(scaler(s)) for s in (2.0, 0.5, 0.25)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, (linear, scale) in enumerate(zip(self.linears, self.scales)):
            x = scale(linear(torch.sin(x) if i else x))
        return x



def test_segments_calling_different_closures_of_one_function_compile_apart() -> None:
    torch.manual_seed(0)
    stage = _ScaledSteps()
    options = {**OPTIONS, "split_ops": [torch.sin], "token_local_ops": stage.scales, "fold_graph_ops": 0}
    compiled = torch.compile(stage, backend="pp_breakable", dynamic=True, options=options)
    x = torch.randn(8, 8)
    ppcompile.mark_token_dynamic(x)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), stage(x))
    records = graphed_runtime().compiled.record.segment_compiles
    assert len(records) == 3 and not any(r.reused for r in records)

"""``tracing.MARKER_OPS``: every marker op the trace aids leave in Dynamo's graph is a registered op, the
pass said to remove it runs before the passes that read single ops, and no marker is left in a compiled
stage's split module, traced once with stamps or with nested regions."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from reference_runs import run_middle_stage
from stage_checks import assert_close

import ppcompile
import ppcompile.tracing.layer_stamps
import ppcompile.tracing.marker_ops
from ppcompile.models import REFERENCE_CONFIGS, make_stage
from ppcompile.passes.manager import PASSES
from ppcompile.tracing import MARKER_OPS

PASS_NAMES = [p.__name__ for p in PASSES]
OPTIONS = {"segment_compiler": "eager", "graph_mode": "emulate", "max_capture_tokens": 16}
COUNTS = (1, 8, 9, 23)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("qualname", sorted(MARKER_OPS))
def test_each_marker_is_a_registered_op_removed_before_token_dims_are_read(qualname: str) -> None:
    namespace, name = qualname.split("::")
    assert hasattr(getattr(torch.ops, namespace), name), qualname
    remover = MARKER_OPS[qualname]
    assert remover in PASS_NAMES, (qualname, remover)
    assert PASS_NAMES.index(remover) < PASS_NAMES.index("find_token_dims")


def _marker_calls(gm: torch.fx.GraphModule) -> list[str]:
    found = []
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            found += [str(n.target) for n in module.graph.nodes
                      if n.op == "call_function" and str(getattr(n.target, "_name", n.target)).split(".")[0]
                      in MARKER_OPS]
    return found


@pytest.mark.skipif(getattr(torch.compiler, "nested_compile_region", None) is None,
                    reason="this torch has no nested_compile_region")
@pytest.mark.parametrize("stamp", [True, False], ids=["stamped", "nested-regions"])
def test_no_marker_is_left_in_a_compiled_stage(stamp: bool) -> None:
    cfg = REFERENCE_CONFIGS["small-dense"].replace(num_layers=9)
    stage = ppcompile.trace_layers_once(make_stage(cfg, 1, 3), stamp=stamp, min_region_modules=1)
    got, want, runtime = run_middle_stage(stage, cfg, OPTIONS, COUNTS)
    for n, g, w in zip(COUNTS, got, want):
        assert_close(g, w, f"at {n} tokens")
    split = runtime.compiled.record.split_module
    assert split is not None
    assert _marker_calls(split) == []

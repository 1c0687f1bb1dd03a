"""Debug modes: ``graph_mode="eager"`` (the static-buffer data path without graphs) tells a graph bug from a
padding/buffer bug; ``debug=True`` checks at every replay that graphs read the tensors they captured."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from debug_helpers import compile_stage, read_report
from runtime_helpers import executors_made_by

import ppcompile
from ppcompile.runtime import executors, static_buffers
from ppcompile.runtime.executors import ReplayAddressError

COUNTS = (10, 16, 5)  # a bucket + padding, a bucket exactly, the smallest bucket + padding


def _close(got: Any, want: Any) -> bool:
    return all(torch.allclose(got[k], want[k], atol=1e-5) for k in want)


def _verdicts(graph_mode: str, wrap: Any = None) -> list[bool]:
    """Whether the compiled stage matches the plain module at each token count (graph path each time),
    with the graph path's parts wrapped by ``wrap`` (``StageRuntime.instrumented``) after the first."""
    stage = compile_stage({"graph_mode": graph_mode})
    out = []
    for i, n in enumerate(COUNTS):
        with contextlib.ExitStack() as stack:
            if i and wrap is not None:
                stack.enter_context(stage.runtime.instrumented(wrap))
            with ppcompile.counters.expect(replays=1, eager_runs=0):
                got = stage.call(n, seed=i)
        out.append(_close(got, stage.call(n, seed=i, compiled=False)))
    return out


def test_eager_graph_mode_is_the_static_buffer_path_without_graphs(tmp_path: Path) -> None:
    stage = compile_stage({"graph_mode": "eager", "dump_dir": str(tmp_path)})
    for i, n in enumerate(COUNTS):
        with ppcompile.counters.expect(replays=1, eager_runs=0, replays_by_bucket={16 if n > 8 else 8: 1}):
            got = stage.call(n, seed=i)
        assert _close(got, stage.call(n, seed=i, compiled=False))
    report = read_report(str(tmp_path / stage.runtime.name))
    assert report["graph_mode"] == "eager" and report["static_buffers"]  # same buffers as a graph mode


class StaleReplays(executors.EmulatedGraphExecutor):
    """A graph bug: replays "forget" to run, leaving the outputs of the capture run."""

    def replay(self, key: Any, args: Sequence[Any]) -> Any:
        return self._captured[key].outputs

    def bound_replay(self, key: Any) -> Callable[[], Any]:
        return functools.partial(self.replay, key, ())


def _stale_replays(mode: str, debug: bool, device: Any, agreement: Any) -> executors.GraphExecutor:
    if mode == "emulate":
        return StaleReplays(debug, agreement)
    return executors.make_executor(mode, debug, device, agreement)


def test_a_graph_bug_shows_with_graphs_only() -> None:
    """A graph that replays stale results: wrong under ``emulate``, right under ``eager``."""
    with executors_made_by(_stale_replays):  # the runtimes these calls build take the buggy executor
        assert _verdicts("eager") == [True, True, True]
        assert _verdicts("emulate") == [False, False, False]


def test_a_buffer_bug_shows_in_both_modes() -> None:
    """A copy-in that drops the last live row: wrong with graphs and without."""
    def lossy(category: str, fn: Any) -> Any:
        if fn is not static_buffers.copy_rows or category != "copy-in":
            return fn

        def lossy_copy_rows(buf: torch.Tensor, src: torch.Tensor, *args: Any) -> None:
            fn(buf, src, *args)
            if src.dim() and src.shape[0] > 1:
                buf[src.shape[0] - 1].zero_()

        return lossy_copy_rows

    assert _verdicts("eager", lossy) == [True, False, False]  # the first call runs unwrapped
    assert _verdicts("emulate", lossy) == [True, False, False]


def test_debug_checks_replay_addresses() -> None:
    stage = compile_stage({"debug": True})
    stage.call(10)  # captures; the check passes for a correct runtime
    rt = stage.runtime
    (state,) = rt.instances()
    table = state.tables[16]
    slot = next(s for s in state.input_buffers)
    table[slot] = table[slot].clone()  # a runtime bug: the graph is handed a tensor it did not capture
    with pytest.raises(ReplayAddressError, match="at bucket 16 was captured reading input"):
        stage.call(10)

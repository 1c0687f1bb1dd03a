"""Whole-stage graphs (``runtime/whole_stage.py``) on a toy stage whose break is declared capturable
(``whole_stage_toy.py``): equal to eager for any requests that fit a bucket, padded by the contract,
breakable when a forward does not fit, and the contract's mutations caught."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from cuda_double import StrictCuda
from hypothesis import given, settings
from hypothesis import strategies as st
from runtime_helpers import CaptureHooks, symbolic_runtime
from whole_stage_toy import CONTRACT, MixStage, make_meta

import ppcompile
from ppcompile import counters
from ppcompile.backends.pp_breakable import compile_stage, serve_stage
from ppcompile.backends.stored_stage import dumps_compiled_stage, loads_compiled_stage
from ppcompile.capturable import declare_capturable
from ppcompile.runtime import whole_stage
from ppcompile.runtime.executors import CudaGraphExecutor
from ppcompile.runtime.fall_offs import WHOLE_CAPTURE_FAILED
from ppcompile.runtime.whole_stage import WholeGraphs

OPTIONS = {"capture_sizes": [2, 4, 8, 16], "graph_mode": "emulate", "whole_graph_tokens": 8}
HIDDEN = 8


class Pair:
    """A compiled toy stage beside an eager copy; :meth:`check` runs both on one batch and compares
    outputs and caches, and that the compiled stage wrote no cache row outside the live slots."""

    def __init__(self, **options: Any) -> None:
        self.stage = MixStage(HIDDEN)
        self.eager = copy.deepcopy(self.stage)
        self.compiled = torch.compile(self.stage, backend="pp_breakable", dynamic=True,
                                      options={**OPTIONS, **options})
        self.calls = 0
        # Dynamo's duck shaping gives equal sizes one symbol: a first call whose request starts have as many
        # entries as it has tokens would be specialised to that and recompiled at the next call.
        self.check([3])

    def run(self, lens: list[int], first_slot: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        x = torch.randn(sum(lens), HIDDEN, generator=torch.Generator().manual_seed(self.calls))
        starts, slots = make_meta(lens, first_slot)
        before = [c.clone() for c in self.stage.caches()]
        with torch.no_grad():
            want = self.eager(x, starts, slots)
            got = self.compiled(x.clone(), starts.clone(), slots.clone())
        live = set(slots.tolist())
        for old, new in zip(before, self.stage.caches()):
            untouched = [r for r in range(old.shape[0]) if r not in live]
            assert torch.equal(old[untouched], new[untouched]), "a cache row outside the live slots changed"
        return got, want

    def check(self, lens: list[int], first_slot: int = 0) -> None:
        got, want = self.run(lens, first_slot)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        for mine, theirs in zip(self.stage.caches(), self.eager.caches()):
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)

    def whole(self) -> WholeGraphs:
        (state,) = symbolic_runtime(self.compiled).instances()
        assert state.whole is not None
        return state.whole


@pytest.fixture
def pair(fresh_dynamo: None) -> Pair:
    return Pair()


@pytest.fixture
def declared() -> Iterator[Callable[..., None]]:
    """Re-declares the toy op for one test (``declare(**fields)``); the toy's own contract after it."""
    yield lambda **fields: declare_capturable("pptest::causal_mix", fields.pop("metadata", CONTRACT),
                                              **fields)
    declare_capturable("pptest::causal_mix", CONTRACT)


def test_small_forwards_replay_one_whole_graph_per_bucket(pair: Pair) -> None:
    paths = []
    for lens in ([2], [3], [1, 2, 1, 4], [5, 4], [9, 8]):  # a bucket, a bucket + 1, 4 requests, > 8, > cap
        before = counters.snapshot()
        pair.check(lens)
        after = counters.snapshot()
        paths.append("whole" if after["whole_replays"] > before["whole_replays"]
                      else "breakable" if after["replays"] > before["replays"] else "eager")
    assert paths == ["whole", "whole", "whole", "breakable", "eager"]
    whole = pair.whole()
    assert whole.buckets == (2, 4, 8) and whole.captured_buckets == (2, 4, 8)
    rt = symbolic_runtime(pair.compiled)
    assert "whole-stage graphs: buckets [2, 4, 8]" in rt.describe()


@pytest.mark.parametrize(("capture", "after_first"), [("all", (2, 4, 8)), ("lazy", (4,))])
def test_capture_all_takes_every_whole_bucket_at_the_first_call(fresh_dynamo: None, capture: str,
                                                                after_first: tuple[int, ...]) -> None:
    pair = Pair(capture=capture)  # its first call: 3 tokens, bucket 4
    assert pair.whole().captured_buckets == after_first
    for lens in ([1, 1], [2, 3, 1, 1], [2]):  # buckets 2, 8, 2: the ones captured with no live row
        pair.check(lens)
    assert pair.whole().captured_buckets == (2, 4, 8)


def test_one_graph_per_whole_bucket_is_captured(fresh_dynamo: None) -> None:
    hooks = CaptureHooks()
    with hooks.injected():
        pair = Pair()
        for lens in ([2], [1, 1], [3], [2, 2], [4, 4], [1, 7]):
            pair.check(lens)
    whole_keys = [key for key in hooks.keys if key[0] == -1]
    assert sorted(whole_keys) == [(-1, 2), (-1, 4), (-1, 8)]  # each once, at its first use


def test_whole_graphs_equal_eager_for_any_requests_that_fit(fresh_dynamo: None) -> None:
    pair = Pair()

    @settings(max_examples=40, deadline=None, derandomize=True)
    @given(st.lists(st.integers(1, 4), min_size=1, max_size=6).filter(lambda ls: 2 <= sum(ls) <= 8),
           st.integers(0, 40))
    def check(lens: list[int], first_slot: int) -> None:
        pair.check(lens, first_slot)

    check()
    assert pair.whole().captured_buckets  # the examples ran whole


def _contract_holds(whole: WholeGraphs, lens: list[int], first_slot: int) -> None:
    n, b = sum(lens), whole.bucket_for_tokens(sum(lens))
    starts, slots = make_meta(lens, first_slot)
    buffers = whole.buffers(b)
    capacity = whole.plan.requests_for(b)
    want_starts = torch.cat([starts, starts[-1:].expand(capacity + 1 - len(starts))])
    assert torch.equal(buffers["l_starts_"], want_starts), "padded requests must have zero length"
    assert torch.equal(buffers["l_slots_"], torch.cat([slots, torch.full((b - n,), -1)])), \
        "padded rows must write slot -1"
    assert not buffers["l_x_"][n:].any(), "padded token rows must be zero"


def test_metadata_buffers_hold_live_rows_then_the_declared_padding(pair: Pair) -> None:
    for lens, first in (([3, 4], 10), ([1, 1], 30), ([2, 3], 0), ([2], 5)):  # shrinking in one bucket
        pair.check(lens, first)
        _contract_holds(pair.whole(), lens, first)


def _tail_left_stale(buf: torch.Tensor, src: torch.Tensor, meta: Any) -> None:
    buf[tuple(slice(0, s) for s in src.shape)].copy_(src)


def _sentinel_with_length(buf: torch.Tensor, src: torch.Tensor, meta: Any) -> None:
    ORIGINAL(buf, src, meta)
    if meta.rows is whole_stage.Rows.REQUEST_STARTS and buf.shape[0] > src.shape[0]:
        tail = buf[src.shape[0]:]
        tail += torch.arange(1, tail.shape[0] + 1, dtype=tail.dtype)


def _padded_slot_zero(buf: torch.Tensor, src: torch.Tensor, meta: Any) -> None:
    ORIGINAL(buf, src, meta)
    if meta.rows is whole_stage.Rows.TOKENS:
        buf[src.shape[0]:] = 0


ORIGINAL = whole_stage.pad_metadata
SEQUENCE = (([3, 4], 10), ([1, 1], 30), ([2, 3], 0), ([2], 5))


def _caught(monkeypatch: pytest.MonkeyPatch, mutant: Callable[..., None]) -> bool:
    """Whether the end-to-end checks or the contract check fail with ``pad_metadata`` mutated."""
    torch._dynamo.reset()
    pair = Pair()
    with monkeypatch.context() as m:
        m.setattr(whole_stage, "pad_metadata", mutant)
        try:
            for lens, first in SEQUENCE:
                pair.check(lens, first)
                _contract_holds(pair.whole(), lens, first)
        except AssertionError:
            return True
    return False


@pytest.mark.parametrize("mutant", [_tail_left_stale, _sentinel_with_length, _padded_slot_zero])
def test_a_broken_padding_rule_is_caught(fresh_dynamo: None, monkeypatch: pytest.MonkeyPatch,
                                         mutant: Callable[..., None]) -> None:
    assert not _caught(monkeypatch, ORIGINAL)
    assert _caught(monkeypatch, mutant)


def test_more_requests_than_a_bucket_holds_run_breakable(fresh_dynamo: None,
                                                         declared: Callable[..., None]) -> None:
    declared(max_requests=2)
    pair = Pair()
    pair.check([2, 2])
    before = counters.snapshot()
    pair.check([1, 1, 2])  # 3 requests in bucket 4, which holds 2
    after = counters.snapshot()
    assert after["whole_replays"] == before["whole_replays"] and after["replays"] == before["replays"] + 1
    assert pair.whole().plan.requests_for(4) == 2


def test_a_truncating_capacity_check_is_caught(fresh_dynamo: None, declared: Callable[..., None],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    declared(max_requests=2)

    def truncating(buf: torch.Tensor, src: torch.Tensor, meta: Any) -> None:
        rows = min(buf.shape[0], src.shape[0])
        ORIGINAL(buf, src[:rows], meta)

    monkeypatch.setattr(WholeGraphs, "_fits", lambda self, args, n, b: True)
    monkeypatch.setattr(whole_stage, "pad_metadata", truncating)
    pair = Pair()
    with pytest.raises(AssertionError):
        pair.check([1, 1, 2])


def test_a_failed_whole_capture_leaves_that_bucket_breakable(fresh_dynamo: None) -> None:
    def fail(key: tuple[int, int]) -> None:
        if key == (-1, 4):
            raise RuntimeError("injected whole-stage capture failure")

    with CaptureHooks(on_capture=fail).injected():
        pair = Pair()
        pair.check([3])
        pair.check([2, 1])
        pair.check([2])
    whole = pair.whole()
    assert 4 in whole.failed_buckets and whole.captured_buckets == (2, 8)
    assert WHOLE_CAPTURE_FAILED in symbolic_runtime(pair.compiled).fall_offs()


def test_outputs_stay_valid_after_the_next_call(pair: Pair) -> None:
    first, want = pair.run([3])
    pair.run([2, 2])
    torch.testing.assert_close(first, want, atol=1e-5, rtol=0)


def test_whole_graphs_pass_the_strict_cuda_double(strict_cuda: StrictCuda, fresh_dynamo: None) -> None:
    pair = Pair()
    before = counters.whole_replays
    for lens in ([2], [1, 2], [2, 2], [1, 1, 1, 1, 3], [5, 3]):
        pair.check(lens, first_slot=7)
    whole = pair.whole()
    assert isinstance(whole.executor, CudaGraphExecutor)
    assert whole.captured_buckets == (2, 4, 8)
    assert counters.whole_replays - before == 5


# ----------------------------------------------------------------------------------- refusals
def _reason(stage: torch.nn.Module, lens: list[int] = [2, 2], **options: Any) -> str | None:  # noqa: B006
    compiled = torch.compile(stage, backend="pp_breakable", dynamic=True, options={**OPTIONS, **options})
    starts, slots = make_meta(lens)
    with torch.no_grad():
        compiled(torch.randn(sum(lens), HIDDEN), starts, slots)
    rt = symbolic_runtime(compiled)
    assert rt.compiled.whole is None
    return rt.compiled.whole_reason


class _ComputedSlots(MixStage):
    def forward(self, x: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return super().forward(x, starts, slots + 1)


class _Undeclared(MixStage):
    def forward(self, x: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        out = super().forward(x, starts, slots)
        return out - out.mean(0)  # mixes every row: a padding-unsafe break


def test_stages_that_cannot_run_whole_say_why(fresh_dynamo: None, declared: Callable[..., None]) -> None:
    assert "computed inside the stage" in (_reason(_ComputedSlots(HIDDEN)) or "")
    torch._dynamo.reset()
    reason = _reason(_Undeclared(HIDDEN)) or ""
    assert "mean" in reason and "no capture contract" in reason
    torch._dynamo.reset()
    assert _reason(MixStage(HIDDEN), whole_graph_tokens=0) is None
    torch._dynamo.reset()
    declared(host_plan="a FlashInfer-style plan()")
    assert "needs a host plan()" in (_reason(MixStage(HIDDEN)) or "")
    torch._dynamo.reset()
    declared(host_plan="a FlashInfer-style plan()", planned_outside=True)
    pair = Pair()
    pair.check([2, 2])
    assert pair.whole().captured_buckets == (2, 4, 8)


@torch.library.custom_op("pptest::host_mix", mutates_args=())
def host_mix(x: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    return x * int(starts[-1].item())


@host_mix.register_fake
def _(x: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


declare_capturable("pptest::host_mix", {"starts": CONTRACT["starts"]})


class _HostReading(MixStage):
    def forward(self, x: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return torch.ops.pptest.host_mix(super().forward(x, starts, slots), starts)


def test_a_declared_op_that_reads_the_host_is_refused(fresh_dynamo: None) -> None:
    reason = _reason(_HostReading(HIDDEN)) or ""
    assert "declared capturable, but" in reason and "host" in reason


def test_whole_graph_tokens_is_validated() -> None:
    with pytest.raises(ValueError, match="whole_graph_tokens"):
        ppcompile.config.PPBreakableConfig.from_options({"whole_graph_tokens": -1})


class _WritesItsInput(MixStage):
    def forward(self, x: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        x.mul_(2)  # the caller sees its tensor doubled
        return super().forward(x, starts, slots)


def test_an_input_the_stage_writes_reaches_the_caller(fresh_dynamo: None) -> None:
    stage = _WritesItsInput(HIDDEN)
    eager = copy.deepcopy(stage)
    compiled = torch.compile(stage, backend="pp_breakable", dynamic=True, options=OPTIONS)
    for lens in ([3], [2, 2], [1, 2]):
        x = torch.randn(sum(lens), HIDDEN)
        starts, slots = make_meta(lens)
        mine, theirs = x.clone(), x.clone()
        before = counters.whole_replays
        with torch.no_grad():
            torch.testing.assert_close(compiled(mine, starts, slots), eager(theirs, starts, slots))
        assert counters.whole_replays == before + 1
        torch.testing.assert_close(mine, theirs)
    (state,) = symbolic_runtime(compiled).instances()
    assert state.whole is not None and any(i.written for i in state.whole.plan.inputs)


def test_with_an_output_ring_whole_outputs_are_owned_and_need_no_fence(fresh_dynamo: None) -> None:
    pair = Pair(output_slots=2)
    outs = [pair.run(lens) for lens in ([2, 2], [1, 2], [3, 1], [9, 2])]  # whole x3, then the ring's path
    for got, want in outs:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)  # all still valid
    assert ppcompile.fence_outputs(outs[0][0], lambda: None) == 0  # a copy: no ring slot to fence
    assert ppcompile.fence_outputs(outs[-1][0], lambda: None) == 1  # the breakable path's ring view


def test_a_stored_stage_keeps_its_whole_stage_plan(fresh_dynamo: None) -> None:
    """A lowered stage written to bytes and read back (a warm restart's stored stage) serves whole."""
    config = ppcompile.PPBreakableConfig.from_options(OPTIONS)
    restored: list[Any] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        back = loads_compiled_stage(dumps_compiled_stage(compile_stage(gm, example_inputs, config)))
        restored.append(back)
        return serve_stage(back, config, example_inputs)

    stage = MixStage(HIDDEN)
    eager = copy.deepcopy(stage)
    compiled = torch.compile(stage, backend=backend, dynamic=True)
    for lens in ([3], [2, 2], [1, 1, 2]):
        x = torch.randn(sum(lens), HIDDEN)
        starts, slots = make_meta(lens)
        before = counters.whole_replays
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, starts, slots), eager(x, starts, slots))
        assert counters.whole_replays == before + 1
    assert restored and all(r.whole is not None for r in restored)


def test_the_stage_report_shows_the_whole_stage_graphs(pair: Pair) -> None:
    from ppcompile.debug.report import build_report
    from ppcompile.debug.table import format_report

    pair.check([2, 2])
    report = build_report(symbolic_runtime(pair.compiled))
    whole = report["whole_stage"]
    assert whole["buckets"] == [2, 4, 8] and whole["captured"] == [2, 4, 8] and not whole["failed"]
    assert whole["ops"] == ["pptest::causal_mix"]
    assert whole["metadata"] == {"l_starts_": {"rows": "request_starts", "pad": 0},
                                 "l_slots_": {"rows": "tokens", "pad": -1}}
    assert "whole-stage graphs: buckets [2, 4, 8] (captured [2, 4, 8])" in format_report(report)


def test_a_forward_beyond_the_padding_guard_is_served_whole(fresh_dynamo: None) -> None:
    pair = Pair(max_padding_factor=1.2)  # 3 tokens in bucket 4 (1.33x): the breakable path would not
    paths = []
    for lens in ([2, 1], [1, 4], [6, 3]):  # whole 4, whole 8, then 9 tokens: bucket 16, beyond the guard
        before = counters.snapshot()
        pair.check(lens)
        after = counters.snapshot()
        paths.append("whole" if after["whole_replays"] > before["whole_replays"] else
                     "eager" if after["eager_runs"] > before["eager_runs"] else "breakable")
    assert paths == ["whole", "whole", "eager"]


@pytest.mark.parametrize("mode", ["eager", "emulate"])
def test_every_graph_mode_and_debug_mode_serve_whole(fresh_dynamo: None, mode: str) -> None:
    pair = Pair(graph_mode=mode, debug=True)  # debug: replays check the tensors they were captured with
    before = counters.whole_replays
    for lens in ([2, 2], [1], [3, 4], [9, 2]):  # whole, whole, whole, breakable
        pair.check(lens)
    assert counters.whole_replays - before == 3 and pair.whole().captured_buckets == (2, 4, 8)

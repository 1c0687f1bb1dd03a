"""Graph semantics under the emulated executor (mixer stage, ``mixer_runtime.py``): what a missing
copy-in or a shared table does, shared output memory across buckets, how long outputs stay valid (views,
owned copies, debug's stale-output checks), and the instrumentation hook."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from mixer_runtime import (
    SIZES,
    Stage,
    check,
    compile_stage,
    inputs,
    only_state,
    symbolic_runtime,
)

from ppcompile.runtime.executors import ReplayAddressError

pytestmark = pytest.mark.usefixtures("fresh_mixer")


def test_owned_outputs_do_not_share_storage_with_static_buffers() -> None:
    m = Stage()
    c = compile_stage(m, owned_outputs=True)
    outs = [check(c, m, n, seed=i) for i, n in enumerate([5, 8, 12])]
    state = only_state(symbolic_runtime(m))
    static: list[torch.Tensor] = [*state.input_buffers.values(), *state.bridge_buffers.values()]
    for cap in state.executor._captured.values():
        static += [t for t in (*cap.args, *cap.outputs) if isinstance(t, torch.Tensor)]
    static_ptrs = {t.untyped_storage().data_ptr() for t in static}
    for group in outs:
        for t in group:
            assert t.untyped_storage().data_ptr() not in static_ptrs


def test_emulator_catches_a_missing_copy_in() -> None:
    x, r = inputs(6, seed=7)

    def skip_copy_in(category: str, fn: Any) -> Any:
        return (lambda buf, src, *a: None if src is x or src is r else fn(buf, src, *a)
                ) if category == "copy-in" else fn

    m = Stage()
    c = compile_stage(m)
    check(c, m, 5)  # with copy-in: correct
    with symbolic_runtime(m).instrumented(skip_copy_in):
        got, _ = c(x, r)  # x and r are not copied in: the static buffers still hold the last call's rows
    want, _ = m(x, r)
    assert not torch.allclose(got, want), "a runtime without copy-in must give wrong answers under emulation"
    check(c, m, 6, seed=7)


def test_buckets_share_graph_output_memory_and_outputs_last_until_the_next_call() -> None:
    """As graphs in one pool whose outputs nobody holds: every bucket's outputs live in the memory of
    the largest bucket's, each segment runs once at capture, and any call overwrites earlier views
    (``owned_outputs=False``)."""
    m = Stage()
    c = compile_stage(m, owned_outputs=False)
    first, _ = check(c, m, 12)  # bucket 16
    state = only_state(symbolic_runtime(m))
    for st in (st for st in symbolic_runtime(m).program.steps if st.segment.is_graph):
        biggest = state.executor._captured[(st.index, 16)].outputs
        for b in SIZES:
            for out, big in zip(state.executor._captured[(st.index, b)].outputs, biggest):
                assert out.untyped_storage().data_ptr() == big.untyped_storage().data_ptr()
                assert out.shape[0] == b
    kept = first.clone()
    second, _ = check(c, m, 6, seed=3)  # bucket 8: overwrites bucket 16's outputs too
    assert not torch.allclose(first, kept)
    torch.testing.assert_close(first[:6], second)
    check(c, m, 12, seed=4)  # and back: each bucket still computes its own answer


def test_debug_turns_a_shared_table_into_a_clear_error() -> None:
    m = Stage()
    c = compile_stage(m, debug=True)
    check(c, m, 12)
    state = only_state(symbolic_runtime(m))
    state.tables[8] = state.tables[16]
    with pytest.raises(ReplayAddressError, match="at bucket 8"):
        c(*inputs(6, seed=3))


def test_views_are_valid_until_the_next_call() -> None:
    """Invariant 4: with ``owned_outputs=False``, outputs are views into static outputs that the next call
    overwrites."""
    m = Stage()
    c = compile_stage(m, owned_outputs=False)
    first, _ = check(c, m, 5, seed=1)
    kept = first.clone()
    second, _ = check(c, m, 6, seed=2)  # same bucket (8), other inputs
    assert not torch.allclose(first, kept), "the emulator must expose outputs overwritten by the next call"
    torch.testing.assert_close(first, second[:5])


@pytest.mark.parametrize("options", [{}, {"owned_outputs": True}], ids=["default", "owned"])
def test_owned_outputs_survive_the_next_call(options: dict[str, Any]) -> None:
    m = Stage()
    c = compile_stage(m, **options)
    first, first2 = check(c, m, 5, seed=1)
    kept, kept2 = first.clone(), first2.clone()
    check(c, m, 6, seed=2)
    check(c, m, 5, seed=3)
    assert torch.equal(first, kept) and torch.equal(first2, kept2)


def test_debug_detects_reading_a_stale_view() -> None:
    m = Stage()
    c = compile_stage(m, owned_outputs=False, debug=True)
    first, _ = check(c, m, 5, seed=1)
    check(c, m, 6, seed=2)
    with pytest.raises(RuntimeError, match="stale"):
        _ = first + 0


def test_instrumented_wraps_replays_breaks_and_copy_in_only_inside_the_block() -> None:
    m = Stage()
    c = compile_stage(m)
    check(c, m, 5)
    rt = symbolic_runtime(m)
    calls: dict[str, int] = {}

    def wrap(category: str, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[category] = calls.get(category, 0) + 1
            return fn(*args, **kwargs)
        return counted

    for _ in range(2):
        with rt.instrumented(wrap):
            check(c, m, 6)
    # Per call: two graph replays, one break, x and residual copied in, the break's output bridged.
    assert calls == {"graph replays": 2 * 2, "break segments": 2, "copy-in": 2 * 2, "bridge copies": 2}
    before = dict(calls)
    check(c, m, 7)
    assert calls == before  # outside the block: the plain code

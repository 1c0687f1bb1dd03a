"""Bad input at the runtime boundary (docs/reliability.md, "Input validation").

With Dynamo's guards on (the default), a changed dtype, device, rank, fixed size, stride pattern or
aliasing pattern makes Dynamo recompile, so the stage graph's runtime never sees it. With guards dropped
(``guard_filter_fn``, as engines with custom dispatchers do) the runtime checks every input it copies
into a static buffer and raises ``InputMismatchError`` naming the input, the expected and the actual
value, before it writes anything. Either way the next valid call is correct.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from plan_variants import compile_recorded, graph_path_call
from reliability_helpers import (
    OPTIONS,
    FeedbackStage,
    H,
    Stage,
    assert_matches,
    check,
    compile_stage,
    inputs,
    no_guards,
    runtime,
    static_snapshot,
)

from ppcompile import counters
from ppcompile.runtime import validation
from ppcompile.runtime.validation import InputMismatchError

Args = tuple[torch.Tensor, torch.Tensor]

# (case, inputs for 5 tokens, pattern the error must match: input name, expected, actual)
BAD: list[tuple[str, Callable[[], Args], str]] = [
    ("dtype", lambda: (inputs(5)[0].double(), inputs(5)[1]),
     r"input 'l_x_' .*expected dtype torch.float32, got torch.float64"),
    ("integer dtype", lambda: (inputs(5)[0], inputs(5)[1].long()),
     r"input 'l_residual_' .*expected dtype torch.float32, got torch.int64"),
    ("trailing shape", lambda: (torch.randn(5, H + 1), torch.randn(5, H + 1)),
     rf"input 'l_x_' .*expected shape \[5, {H}\], got \[5, {H + 1}\]"),
    ("broadcastable trailing shape", lambda: (inputs(5)[0], torch.randn(5, 1)),
     rf"input 'l_residual_' .*expected shape \[5, {H}\], got \[5, 1\]"),
    ("rank", lambda: (inputs(5)[0][:, :, None], inputs(5)[1]),
     r"input 'l_x_' .*expected rank 2, got 3 \(shape \[5, 8, 1\]\)"),
    ("device", lambda: (inputs(5)[0].to("meta"), inputs(5)[1]),
     r"input 'l_x_' .*expected device cpu, got meta"),
    ("token dims disagree", lambda: (inputs(5)[0], torch.randn(6, H)),
     rf"input 'l_residual_' .*expected shape \[5, {H}\], got \[6, {H}\].*token dims: l_x_ \[5\], "
     r"l_residual_ \[6\]"),
    ("not a tensor", lambda: (inputs(5)[0], None),  # type: ignore[return-value]
     r"input 'l_residual_' .*expected type a tensor, got NoneType"),
]


def _warm(c: Any, m: Stage) -> None:
    for i, n in enumerate([5, 9, 3]):
        check(c, m, *inputs(n, seed=i))


@pytest.mark.parametrize("case, make, pattern", BAD, ids=[b[0] for b in BAD])
def test_without_guards_bad_input_is_rejected_before_any_write(
    case: str, make: Callable[[], Args], pattern: str
) -> None:
    m = Stage()
    c = compile_stage(m, guard_filter_fn=no_guards)
    with torch.no_grad():
        _warm(c, m)
        rt = runtime()
        before = static_snapshot(rt)
        nothing = counters.expect(backend_compiles=0, replays=0, eager_runs=0, captures=0)
        with nothing, pytest.raises(InputMismatchError, match=pattern) as info:
            c(*make())
        assert "guards" in str(info.value)  # says why it got here and what to do
        for old, new in zip(before, static_snapshot(rt)):
            assert torch.equal(old, new), f"{case}: a rejected call wrote a static buffer"
        check(c, m, *inputs(7, seed=9))  # the next valid call is correct
        check(c, m, *inputs(5, seed=10))


@pytest.mark.parametrize("case, make", [(b[0], b[1]) for b in BAD if b[0] != "not a tensor"],
                         ids=[b[0] for b in BAD if b[0] != "not a tensor"])
def test_with_guards_dynamo_recompiles_and_the_original_runtime_never_sees_it(
    case: str, make: Callable[[], Args]
) -> None:
    """Guards on: the stage recompiles for the new input; the new graph gives eager's answer, or the
    model's own error (eager raises too). The original runtime stays untouched and correct."""
    m = Stage()
    c = compile_stage(m)
    with torch.no_grad():
        _warm(c, m)
        rt = runtime()
        before = static_snapshot(rt)
        args = make()
        try:
            want: Any = m(*args)
        except Exception as e:  # the model itself rejects it
            want = e
        compiles = counters.backend_compiles
        try:
            got: Any = c(*args)
        except Exception as e:
            got = e
        if isinstance(want, Exception):
            assert isinstance(got, Exception), f"{case}: eager raised {want!r}, the compiled stage did not"
        else:
            assert not isinstance(got, Exception), f"{case}: {got!r}"
            assert_matches(got, want)
            assert counters.backend_compiles == compiles + 1, f"{case}: expected a recompile"
        for old, new in zip(before, static_snapshot(rt)):
            assert torch.equal(old, new), f"{case}: the original runtime's buffers changed"
        with counters.expect(backend_compiles=0):
            check(c, m, *inputs(7, seed=9))


@pytest.mark.parametrize("guards", [True, False], ids=["guards", "no guards"])
def test_zero_tokens_give_eagers_empty_outputs(guards: bool) -> None:
    """0 tokens is an empty batch, not an error: Dynamo specializes it (guards on) or the runtime runs
    it eagerly (no bucket serves 0); outputs equal eager's (empty)."""
    m = Stage()
    c = compile_stage(m) if guards else compile_stage(m, guard_filter_fn=no_guards)
    with torch.no_grad():
        _warm(c, m)
        with counters.expect(replays=0, eager_runs=1):
            got = check(c, m, *inputs(0))
        assert all(t.shape == (0, H) for t in got)
        with counters.expect(replays=1, eager_runs=0, backend_compiles=0):
            check(c, m, *inputs(6, seed=4))


LAYOUTS: list[tuple[str, Callable[[int], Args]]] = [
    ("transposed (non-contiguous)", lambda n: (torch.randn(H, n).t(), torch.randn(n, H))),
    ("strided rows (non-contiguous)", lambda n: (torch.randn(2 * n, H)[::2], torch.randn(n, H))),
    ("expanded (stride 0)", lambda n: (torch.randn(n, H), torch.randn(1, H).expand(n, H))),
    ("one tensor twice", lambda n: (lambda t: (t, t))(torch.randn(n, H))),
    ("overlapping views", lambda n: (lambda t: (t[:n], t[1:]))(torch.randn(n + 1, H))),
    ("storage offset", lambda n: (torch.randn(n + 3, H)[3:], torch.randn(n, H))),
]


@pytest.mark.parametrize("guards", [True, False], ids=["guards", "no guards"])
@pytest.mark.parametrize("case, make", LAYOUTS, ids=[c for c, _ in LAYOUTS])
def test_any_memory_layout_gives_eagers_answer(case: str, make: Callable[[int], Args], guards: bool) -> None:
    """Non-contiguous, stride-0, aliased or overlapping inputs are legal: copy-in reads any strides and
    nothing writes an input, so the answer is eager's (Dynamo may recompile for the new layout)."""
    m = Stage()
    c = compile_stage(m) if guards else compile_stage(m, guard_filter_fn=no_guards)
    with torch.no_grad():
        _warm(c, m)
        for n in (5, 8, 13):
            args = make(n)
            kept = [a.clone() for a in args]
            check(c, m, *args)
            assert all(torch.equal(a, k) for a, k in zip(args, kept)), f"{case}: an input was modified"
        check(c, m, *inputs(6, seed=4))


def test_an_output_fed_back_as_input_is_copied_first() -> None:
    """An output of the previous call (a view into static memory, ``owned_outputs=False``) passed back in:
    a break reads it after a graph overwrote that memory, unless the runtime copies it first."""
    m = FeedbackStage()
    c = compile_stage(m, owned_outputs=False)
    with torch.no_grad():
        x = torch.randn(6, H)
        for _ in range(4):
            want = m(x)
            got = c(x)
            assert_matches(got, want)
            x = got[1]  # y: a view into the static output of the first graph segment
        assert counters.replays == 4


def test_without_the_copy_a_fed_back_output_gives_wrong_answers() -> None:
    """The check above has teeth: the instance's graph path alone, without the runtime's aliased-input
    copy around it, gives a wrong answer for a fed-back output."""
    m = FeedbackStage()
    c, recorded = compile_recorded(m, {**OPTIONS, "owned_outputs": False}, dynamic=True, fullgraph=True)
    with torch.no_grad():
        got = c(torch.randn(6, H))
        runtime = recorded.runtime
        (slot,) = runtime.compiled.tensor_slots
        args = list(recorded.args())
        args[slot] = got[1]  # y: a view into the static output of the first graph segment
        want = m(got[1].clone())
        wrong = graph_path_call(runtime, tuple(args), 6)
        assert not torch.allclose(wrong[0], want[0])
        assert_matches(c(want[1].clone()), m(want[1].clone()))


def test_validation_is_built_from_the_lifted_inputs() -> None:
    m = Stage()
    c = compile_stage(m)
    with torch.no_grad():
        check(c, m, *inputs(5))
    specs = runtime().compiled.input_specs
    assert [s.name for s in specs] == ["l_x_", "l_residual_"]
    for s in specs:
        assert s.dtype == torch.float32 and s.device == torch.device("cpu") and s.ndim == 2
        assert s.fixed == ((1, H),) and [d for d, _ in s.sized] == [0]


def test_check_inputs_names_the_wrong_input_count() -> None:
    with pytest.raises(InputMismatchError, match="called with 1 inputs, expected 2"):
        validation.check_inputs((), (torch.zeros(1),), 2, {}, "stage_x", "dim 0 of input 'x'")

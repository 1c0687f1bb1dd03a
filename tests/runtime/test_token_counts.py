"""One token count over inputs marked dynamic one by one, as vLLM marks them (``runtime/token_counts.py``).

vLLM marks ``input_ids``, ``positions`` and each PP proxy dynamic on dim 0 separately, and relates
``positions`` to the hidden states only through its own ops (a rotary embedding, a fused add), whose
fake implementations relate no sizes: Dynamo gives each input a symbol of its own. The stage here does
the same with two custom ops, so the three inputs keep three symbols. The stage serves them as one
token count (no non-token-shape break at the rotary op; graphs replay), and a call where they differ
runs the traced graph op by op.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from mixer_stage import register_mixer
from stage_checks import assert_close
from torch import nn

import ppcompile
from ppcompile.records import BreakKind

H = 8
SIZES = [1, 4, 8]
CAP = SIZES[-1]
NAMESPACE = "pptest_token_counts"

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "one_thread")

mixer = register_mixer(f"{NAMESPACE}::mixer", lambda x: None)


@torch.library.custom_op(f"{NAMESPACE}::rope", mutates_args=())
def rope(positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor, num_positions: int) -> torch.Tensor:
    """A rotary embedding of ``x``'s rows by the first ``len(x)`` positions (an engine may hand a longer
    positions buffer); ``num_positions``, a size argument, must be the live length of ``positions``."""
    assert positions.shape[0] == num_positions, (positions.shape, num_positions)
    c, s = cos_sin[positions[: x.shape[0]]].chunk(2, dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


@rope.register_fake
def _(positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor, num_positions: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op(f"{NAMESPACE}::add_rows", mutates_args=())
def add_rows(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """An engine's fused add (as ``fused_add_rms_norm``): its fake relates no sizes either."""
    return x + y


@add_rows.register_fake
def _(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


OPTIONS: dict[str, Any] = {"capture_sizes": SIZES, "graph_mode": "emulate",
                           "token_local_ops": [f"{NAMESPACE}::rope", f"{NAMESPACE}::add_rows"]}


class RotaryStage(nn.Module):
    """graph (embed ids + hidden states, q, rotary by positions, up) | break (mixer) | graph (down)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, H)
        self.q, self.up, self.down = nn.Linear(H, H), nn.Linear(H, 2 * H), nn.Linear(2 * H, H)
        self.register_buffer("cos_sin", torch.randn(64, H))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                proxies: dict[str, torch.Tensor]) -> torch.Tensor:
        x = add_rows(self.embed(input_ids), proxies["hidden_states"])
        q = rope(positions, self.q(x), self.cos_sin, positions.shape[0])
        return self.down(mixer(torch.relu(self.up(q))))


def inputs(n: int, seed: int, num_positions: int | None = None) -> tuple[Any, ...]:
    """A call's inputs, each marked dynamic on dim 0 by itself (``torch._dynamo.mark_dynamic``)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32, (n,), generator=g)
    positions = torch.randint(0, 64, (num_positions or n,), generator=g)
    proxies = {"hidden_states": torch.randn(n, H, generator=g)}
    for t in (ids, positions, proxies["hidden_states"]):
        torch._dynamo.mark_dynamic(t, 0)
    return ids, positions, proxies


def drop_all_guards(entries: list[Any]) -> list[bool]:
    return [False] * len(entries)


def compiled(mode: str, options: dict[str, Any] | None = None) -> tuple[RotaryStage, Any]:
    """``default``: ``torch.compile`` as a user calls it; ``vllm``: as vLLM's DYNAMO_TRACE_ONCE mode does
    (``dynamic=False`` with the inputs marked, ``fullgraph``, every guard dropped)."""
    m = RotaryStage()
    options = {**OPTIONS, **(options or {})}
    if mode == "vllm":
        options["guard_filter_fn"] = drop_all_guards
        return m, torch.compile(m, backend="pp_breakable", dynamic=False, fullgraph=True, options=options)
    return m, torch.compile(m, backend="pp_breakable", options=options)


def symbolic_runtime() -> Any:
    (runtime,) = [rt for rt in ppcompile.stage_runtimes() if rt.token_symbol is not None]
    return runtime


def test_dynamo_gives_each_marked_input_a_symbol_of_its_own() -> None:
    """The premise: without the merge, the three inputs would be three token counts."""
    seen: list[tuple[str, ...]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        for p in gm.graph.find_nodes(op="placeholder"):
            value = p.meta.get("example_value")
            if isinstance(value, torch.Tensor) and value.dim() and isinstance(value.shape[0], torch.SymInt):
                seen.append((p.name, str(value.shape[0].node.expr)))
        return gm.forward

    with torch.no_grad():
        torch.compile(RotaryStage(), backend=backend, dynamic=False, fullgraph=True)(*inputs(6, 0))
    symbols = dict(seen)
    assert set(symbols) == {"l_input_ids_", "l_positions_", "l_proxies_hidden_states_"}
    assert len(set(symbols.values())) == 3, symbols


@pytest.mark.parametrize("mode", ["default", "vllm"])
def test_separately_marked_inputs_are_one_token_count(mode: str) -> None:
    m, c = compiled(mode)
    # 1 token, exactly a bucket, a bucket + 1, above the cap, a bucket again.
    counts = [(6, 8), (1, 1), (8, 8), (5, 8), (9, None), (4, 4)]
    with torch.no_grad():
        for i, (n, bucket) in enumerate(counts):
            args = inputs(n, seed=i)
            expect: dict[str, Any] = {"replays_by_bucket": {bucket: 1}} if bucket else {"eager_runs": 1}
            with ppcompile.counters.expect(token_count_mismatches=0, **expect):
                got = c(*args)
            assert_close(got, m(*args), f"{mode}, {n} tokens")
    runtime = symbolic_runtime()
    # The mixer is the only break: no non-token-shape break at the rotary op reading positions.
    assert [(r.kind, r.op) for r in runtime.break_reasons] == [
        (BreakKind.UNSAFE_OP, f"{NAMESPACE}.mixer.default")], runtime.describe()
    merged = {runtime.compiled.input_names[i] for i, _, _ in runtime.compiled.merged_token_dims}
    assert merged == {"l_positions_", "l_proxies_hidden_states_"}  # l_input_ids_ carries the token symbol
    assert "one token count" in runtime.describe() and "l_positions_ dim 0" in runtime.describe()
    (state,) = runtime.instances()
    assert state.captured_buckets == tuple(SIZES)
    if mode == "vllm":  # every guard dropped: one stage graph serves every count, 1 token included
        assert len(ppcompile.stage_runtimes()) == 1


@pytest.mark.parametrize("mode", ["default", "vllm"])
def test_a_call_whose_token_dims_differ_runs_the_traced_graph_eagerly(
        mode: str, caplog: pytest.LogCaptureFixture) -> None:
    """Positions longer than the tokens (an engine's positions buffer): the plan reads both as one
    count, so the call runs the traced graph op by op, with the live length as the rotary op's size
    argument, and warns once; matched calls keep replaying."""
    m, c = compiled(mode)
    with torch.no_grad():
        c(*inputs(6, seed=0))
        for k, (n, extra) in enumerate([(5, 3), (8, 1)]):
            args = inputs(n, seed=10 + k, num_positions=n + extra)
            with ppcompile.counters.expect(token_count_mismatches=1, eager_runs=1, replays=0):
                got = c(*args)
            assert_close(got, m(*args), f"{mode}, {n} tokens, {n + extra} positions")
        args = inputs(5, seed=20)
        with ppcompile.counters.expect(token_count_mismatches=0, replays_by_bucket={8: 1}):
            assert_close(c(*args), m(*args), f"{mode}, matched after mismatched")
    warnings = [r.getMessage() for r in caplog.records if "differ in size" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "l_positions_ dim 0: 8" in warnings[0] and "l_input_ids_ dim 0: 5" in warnings[0]
    runtime = symbolic_runtime()
    assert runtime.token_counts.mismatches == 2
    assert "2 call(s) where their sizes differed ran eagerly" in runtime.describe()


def test_inductor_segments_serve_the_merged_count() -> None:
    """Inductor compiles the segments for Dynamo's separate symbols: they read each from its input,
    equal on the graph path, and differing ones never reach them."""
    m, c = compiled("vllm", {"segment_compiler": "inductor"})
    with torch.no_grad():
        for i, (n, bucket) in enumerate([(6, 8), (3, 4), (9, None)]):
            args = inputs(n, seed=i)
            expect: dict[str, Any] = {"replays_by_bucket": {bucket: 1}} if bucket else {"eager_runs": 1}
            with ppcompile.counters.expect(**expect):
                assert_close(c(*args), m(*args), f"inductor, {n} tokens")
        args = inputs(4, seed=7, num_positions=6)
        with ppcompile.counters.expect(token_count_mismatches=1, eager_runs=1):
            assert_close(c(*args), m(*args), "inductor, 4 tokens, 6 positions")

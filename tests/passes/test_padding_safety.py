"""Padding safety: row-mixing ops inside graphable regions run eagerly (with a reason) or fail on request;
token-wise ops stay graphed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import ppcompile
from ppcompile.backends.pp_breakable import serve_stage
from ppcompile.backends.segment_compilers import compile_segments
from ppcompile.config import PPBreakableConfig
from ppcompile.lowering import lower_stage
from ppcompile.passes import check_padding_safety
from ppcompile.passes.check_padding_safety import PaddingSafetyError
from ppcompile.passes.context import PassContext
from ppcompile.passes.manager import PASSES, run_passes
from ppcompile.records import BreakKind

H = 8
CAPTURE = [8, 16]
NON_BUCKET_COUNTS = (5, 11)  # padded to 8 and 16

Mixer = Callable[[torch.Tensor], torch.Tensor]

# name -> (row-mixing function, an op name the reason must mention)
ROW_MIXING: dict[str, tuple[Mixer, str]] = {
    "mean over tokens": (lambda h: h - h.mean(0, keepdim=True), "mean"),
    "sum over tokens": (lambda h: h + h.sum(dim=0), "sum"),
    "conv1d reading ahead": (lambda h: _conv(h, padding=1), "conv1d"),
    "reversed cumsum": (lambda h: h.flip(0).cumsum(0).flip(0), "flip"),
    "sort along tokens": (lambda h: torch.sort(h, dim=0).values, "sort"),
    "topk along tokens": (lambda h: h + torch.topk(h, 1, dim=0).values, "topk"),
    "softmax over tokens": (lambda h: torch.softmax(h, dim=0), "softmax"),
    "plain non-causal attention": (lambda h: torch.softmax(h @ h.t(), dim=-1) @ h, "softmax"),
    "matmul contracting tokens": (lambda h: h @ (h.t() @ h), "matmul"),
    "last token": (lambda h: h - h[-1], "getitem"),
    "gather other tokens": (lambda h: h[torch.arange(h.shape[0]).flip(0)], "getitem"),
    "roll along tokens": (lambda h: torch.roll(h, 1, 0), "roll"),
    "reshape of transposed rows": (lambda h: h.t().reshape(h.shape), "reshape"),
}


def _conv(h: torch.Tensor, padding: int, kernel: int = 3) -> torch.Tensor:
    """A depthwise conv1d over the tokens of ``h [T, H]`` (as ``[1, H, T]``), all of its output rows."""
    weight = torch.linspace(-1, 1, H * kernel).view(H, 1, kernel)
    return torch.nn.functional.conv1d(h.t().unsqueeze(0), weight, padding=padding, groups=H)[0].t()


def _causal_conv(h: torch.Tensor) -> torch.Tensor:
    """Causal: padded by kernel - 1 on both sides, the output's first ``T`` rows kept (Qwen3-Next's)."""
    return _conv(h, padding=2)[: h.shape[0]]


# Row i reads rows <= i only: padding appended after the live rows cannot reach a live row.
PREFIX_CAUSAL: dict[str, Mixer] = {
    "cumsum along tokens": lambda h: h.cumsum(0),
    "cummax along tokens": lambda h: torch.cummax(h, 0).values,
    "causal conv1d, tail cut off": _causal_conv,
    "prefix slices": lambda h: h.narrow(0, 0, h.shape[0] - 1)[:-1] * 2,  # n - 2 rows out
    "cumsum over token-major flattened rows": lambda h: h.reshape(-1).cumsum(0).view(h.shape[0], -1),
}


def _rms(h: torch.Tensor) -> torch.Tensor:
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


TOKEN_WISE: dict[str, Mixer] = {
    "rms norm over features": _rms,
    "softmax over features": lambda h: torch.softmax(h, dim=-1),
    "topk over features": lambda h: h + torch.topk(h, 2, dim=-1).values.sum(-1, keepdim=True),
    "gather along features": lambda h: h
    + torch.gather(h, 1, torch.topk(h, 2, dim=-1).indices).sum(-1, keepdim=True),
    "heads reshape and transpose": lambda h: h.view(h.shape[0], 2, H // 2).transpose(0, 1).contiguous()
    .transpose(0, 1).reshape(h.shape[0], H),
    "cat and chunk along features": lambda h: torch.cat(h.chunk(2, dim=-1)[::-1], dim=-1),
    "layer norm": lambda h: torch.nn.functional.layer_norm(h, (H,)),
    "slice features": lambda h: torch.cat([h[:, : H // 2], h[..., H // 2 :]], dim=-1),
    "unsqueeze and sum over new dim": lambda h: h.unsqueeze(1).expand(-1, 3, -1).sum(1),
}


class Stage(torch.nn.Module):
    def __init__(self, mixer: Mixer) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(H, H)
        self.out = torch.nn.Linear(H, H)
        self.mixer = mixer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mixer(self.inp(x))))


def _compile(mixer: Mixer, **options: object) -> tuple[Stage, Callable[..., torch.Tensor]]:
    torch._dynamo.reset()
    stage = Stage(mixer).eval()
    opts = {"capture_sizes": CAPTURE, "graph_mode": "emulate", **options}  # the graph path pads
    return stage, torch.compile(stage, backend="pp_breakable", dynamic=True, fullgraph=True, options=opts)


@pytest.mark.parametrize("name", sorted(ROW_MIXING))
def test_row_mixing_op_runs_eagerly_with_reason(name: str) -> None:
    mixer, op = ROW_MIXING[name]
    stage, compiled = _compile(mixer)
    with torch.no_grad():
        for n in NON_BUCKET_COUNTS:
            x = torch.randn(n, H)
            with ppcompile.counters.expect(replays=1):
                got = compiled(x)
            torch.testing.assert_close(got, stage(x))
    runtime = ppcompile.stage_runtimes()[-1]
    unsafe = [r for r in runtime.break_reasons if r.kind is BreakKind.UNSAFE_OP]
    assert unsafe, runtime.describe()
    assert any(op in str(r) for r in unsafe), runtime.describe()
    assert all(r.stack_trace for r in unsafe)


@pytest.mark.parametrize("name", ["mean over tokens", "last token", "plain non-causal attention"])
def test_on_unsafe_error_names_op_and_line(name: str) -> None:
    mixer, op = ROW_MIXING[name]
    _, compiled = _compile(mixer, on_unsafe="error")
    with torch.no_grad(), pytest.raises(Exception) as info:
        compiled(torch.randn(5, H))
    err = getattr(info.value, "inner_exception", info.value)  # Dynamo wraps backend errors
    assert isinstance(err, PaddingSafetyError)
    assert op in str(err) and "test_padding_safety.py" in str(err)


def _backend_without(skipped: str) -> Callable[..., Any]:
    """A backend compiling as ``pp_breakable`` does (emulated graphs), but through the manager's passes
    without the one named ``skipped``."""

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        config = PPBreakableConfig.from_options({"capture_sizes": CAPTURE, "graph_mode": "emulate"})
        ctx = PassContext(config=config, example_inputs=list(example_inputs), graph_name=f"without_{skipped}")
        split = run_passes(gm, ctx, passes=tuple(p for p in PASSES if p.__name__ != skipped))
        compiled, _ = compile_segments(split, ctx)
        stage = lower_stage(ctx.graph_name, split, ctx, compiled, config, "emulate")
        return serve_stage(stage, config, [*example_inputs, *stage.bound_inputs])

    return backend


def test_without_the_check_padding_leaks() -> None:
    """The check has teeth: skipping it makes a mean over tokens read padded rows."""
    torch._dynamo.reset()
    stage = Stage(ROW_MIXING["mean over tokens"][0]).eval()
    backend = _backend_without("check_padding_safety")
    compiled = torch.compile(stage, backend=backend, dynamic=True, fullgraph=True)
    with torch.no_grad():
        x = torch.randn(5, H)
        assert not torch.allclose(compiled(x), stage(x), atol=1e-4)


@pytest.mark.parametrize("name", sorted(TOKEN_WISE) + sorted(PREFIX_CAUSAL))
def test_token_wise_and_prefix_causal_ops_stay_graphed(name: str) -> None:
    stage, compiled = _compile({**TOKEN_WISE, **PREFIX_CAUSAL}[name])
    with torch.no_grad():
        for n in NON_BUCKET_COUNTS:
            x = torch.randn(n, H)
            torch.testing.assert_close(compiled(x), stage(x))
    runtime = ppcompile.stage_runtimes()[-1]
    assert [s.kind for s in runtime.segments] == ["graph"], runtime.describe()


def test_registered_token_local_op_stays_graphed() -> None:
    @torch.library.custom_op("pptest_pad::scale_rows", mutates_args=())
    def scale_rows(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @scale_rows.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    _, compiled = _compile(lambda h: torch.ops.pptest_pad.scale_rows(h))
    with torch.no_grad():
        compiled(torch.randn(5, H))
    kinds = [r.kind for r in ppcompile.stage_runtimes()[-1].break_reasons]
    assert kinds == [BreakKind.UNSAFE_OP]  # unknown custom op: unsafe by default

    _, compiled = _compile(lambda h: torch.ops.pptest_pad.scale_rows(h),
                           token_local_ops=["pptest_pad::scale_rows"])
    with torch.no_grad():
        compiled(torch.randn(5, H))
    assert ppcompile.stage_runtimes()[-1].break_reasons == []


@pytest.mark.parametrize("name", ["small-moe", "hidden-only", "topk"])
def test_reference_stage_breaks_only_at_attention(name: str) -> None:
    """No needless breaks. Only the token dims are marked dynamic: with ``dynamic=True`` the top-k
    proxy's width would be a second symbol, and what reads it would (rightly) run eagerly."""
    from ppcompile.models import (
        REFERENCE_CONFIGS,
        make_batch,
        make_forward_context,
        make_stage,
        set_forward_context,
    )

    cfg = REFERENCE_CONFIGS[name]
    for rank in range(2):
        torch._dynamo.reset()
        stage = make_stage(cfg, rank, 2)
        compiled = torch.compile(stage, backend="pp_breakable", options={"capture_sizes": CAPTURE})
        ids, pos, proxies = make_batch(cfg, [3, 2], rank, 2)
        for t in (ids, pos, *(proxies or {}).values()):
            if t is not None:
                torch._dynamo.mark_dynamic(t, 0)
        layers = range(stage.start_layer, stage.end_layer)
        with torch.no_grad(), set_forward_context(make_forward_context([3, 2], cfg, layers)):
            compiled(ids, pos, proxies)
        runtime = ppcompile.stage_runtimes()[-1]
        assert [r.kind for r in runtime.break_reasons] == [BreakKind.ATTENTION] * len(layers), (
            runtime.describe()
        )


@torch.library.custom_op("pptest_padding::cache_rows_", mutates_args=("cache",))
def cache_rows_(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor) -> None:
    """A KV-cache write by slot index whose schema says it writes ``cache`` (registered token-local
    below: row i of the cache write depends on row i of ``k`` only)."""
    cache.index_copy_(0, slots, k)


@cache_rows_.register_fake
def _(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor) -> None:
    return None


@torch.library.custom_op("pptest_padding::bump_", mutates_args=("x",))
def bump_(x: torch.Tensor) -> None:
    """``x += 1`` as a custom op whose schema writes ``x`` (registered token-local below)."""
    x.add_(1)


@bump_.register_fake
def _(x: torch.Tensor) -> None:
    return None


class CacheWriter(torch.nn.Module):
    """Writes each token's key into a module buffer by slot index, the way a KV cache is filled."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(H, H)
        self.register_buffer("cache", torch.zeros(64, H))
        self.how = how

    def forward(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        k = self.lin(x)
        if self.how == "index_copy_":
            self.cache.index_copy_(0, slots, k)
        elif self.how == "setitem":
            self.cache[slots] = k
        elif self.how == "slice copy_":
            self.cache[: x.shape[0]].copy_(k)
        elif self.how == "token-local op writing the cache":
            cache_rows_(self.cache, slots, k)
        elif self.how == "token-local op writing the input":
            bump_(x)
        elif self.how == "out= into the input":
            torch.add(k, 1, out=x)
        else:
            x += 1  # mutates the caller's input
        return self.lin(k + x)


@pytest.mark.parametrize("how", ["index_copy_", "setitem", "slice copy_", "input +=",
                                 "token-local op writing the cache", "token-local op writing the input",
                                 "out= into the input"])
def test_in_place_writes_into_inputs_give_eagers_answer(how: str) -> None:
    """A replay writes all b rows: padded rows must not reach a KV-cache-like buffer, so a write into
    module state runs eagerly, whether by an in-place method, ``out=`` or an op whose schema says it writes
    (even one registered token-local). A token-local write into a live input stays in the graph: it lands
    in the input's static buffer, and the runtime copies it back into the caller's tensor."""
    torch._dynamo.reset()
    eager, graphed = CacheWriter(how), CacheWriter(how)
    options = {"capture_sizes": CAPTURE, "graph_mode": "emulate",
               "token_local_ops": ["pptest_padding::cache_rows_", "pptest_padding::bump_"]}
    compiled = torch.compile(graphed, backend="pp_breakable", dynamic=True, options=options)
    with torch.no_grad():
        for n in NON_BUCKET_COUNTS:
            x, slots = torch.randn(n, H), torch.randperm(64)[:n] + 0
            x_eager, x_graphed = x.clone(), x.clone()
            torch.testing.assert_close(compiled(x_graphed, slots), eager(x_eager, slots))
            torch.testing.assert_close(graphed.cache, eager.cache)  # no padded rows written
            torch.testing.assert_close(x_graphed, x_eager)  # the caller's tensor mutated as in eager
    reasons = ppcompile.stage_runtimes()[-1].break_reasons
    into_the_cache = how in ("index_copy_", "setitem", "slice copy_", "token-local op writing the cache")
    assert any(r.kind is BreakKind.UNSAFE_OP and "writes in place" in r.detail for r in reasons) == (
        into_the_cache)


class ChunkPadder(torch.nn.Module):
    """Pads the tokens up to a multiple of 16 the way chunked linear attention does: the pad count
    ``(16 - n % 16) % 16`` shrinks as ``n`` grows, and a pad tensor of that many rows crosses segments."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pad_rows = (16 - x.shape[0] % 16) % 16
        pad = self.lin(torch.ones(pad_rows, H))
        chunked = torch.cat([self.lin(x), pad]).view(-1, 16, H).cumsum(1).view(-1, H)
        return self.lin(chunked[: x.shape[0]]), self.lin(pad).sum(0)


def _compile_padder() -> tuple[ChunkPadder, Callable[..., tuple[torch.Tensor, torch.Tensor]]]:
    torch._dynamo.reset()
    stage = ChunkPadder().eval()
    options = {"capture_sizes": [4, 8, 16, 32], "graph_mode": "emulate", "fold_graph_ops": 0}
    return stage, torch.compile(stage, backend="pp_breakable", options=options)


def _run_padder(stage: ChunkPadder, compiled: Callable[..., Any], counts: Sequence[int]) -> None:
    with torch.no_grad():
        for n in counts:
            x = torch.randn(n, H)
            ppcompile.mark_token_dynamic(x)
            for got, want in zip(compiled(x), stage(x)):
                torch.testing.assert_close(got, want, msg=lambda m, n=n: f"{n} tokens: {m}")


def test_token_sizes_that_shrink_as_tokens_grow_stay_off_graphs() -> None:
    """A bucket ``b > n`` holds ``(16 - b % 16) % 16`` pad rows, fewer than the live count's: every node
    that makes or reads such a tensor runs eagerly, and every count equals eager."""
    stage, compiled = _compile_padder()
    _run_padder(stage, compiled, [8, 5, 16, 17, 31, 32, 3, 40])
    runtime = ppcompile.stage_runtimes()[-1]
    shrinking = [r for r in runtime.break_reasons if "shrinks as the token count grows" in r.detail]
    assert shrinking, runtime.describe()
    assert any(s.is_graph for s in runtime.segments), runtime.describe()
    # Dynamo traced one graph per residue class of the pad count (n % 16 == 15 gives a 1-row pad it
    # specialises); each is captured only at buckets its guards admit.
    assert any(rt.plan.refused for rt in ppcompile.stage_runtimes())


def test_without_the_guard_check_a_bucket_outside_the_traced_counts_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check has teeth: the graph traced for ``n % 16 == 15`` evaluates its sizes at bucket 8,
    where they divide by zero."""
    from ppcompile.lowering import compiled_stage

    monkeypatch.setattr(compiled_stage, "holds_at", lambda *args: True)
    stage, compiled = _compile_padder()
    with pytest.raises(ZeroDivisionError):
        _run_padder(stage, compiled, [8, 5, 16, 17, 31])


def test_without_the_shrink_check_a_bucket_cannot_hold_the_live_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check has teeth: without it the pad tensor is bucket-sized in a graph, and the live count's
    larger pad does not fit it: the run fails (the live view holds fewer rows than the count, and the
    reshape after it cannot take them). The check is what guarantees a live view fits its buffer; the
    generated code's live views are plain slices, which would not raise by themselves."""
    monkeypatch.setattr(check_padding_safety, "first_decrease", lambda *args: None)
    stage, compiled = _compile_padder()
    with pytest.raises(RuntimeError, match=r"exceeds dimension size|is invalid for input of size"):
        _run_padder(stage, compiled, [8, 5])


def test_a_shape_read_by_a_break_is_the_live_shape() -> None:
    """``shape = h.shape`` is computed in a graph segment at the bucket size; the break that reshapes
    with it (a view that folds tokens, as Qwen3-Next's gated delta rule does) must get the live shape."""

    def fold_and_back(h: torch.Tensor) -> torch.Tensor:
        shape = h.shape
        return h.t().reshape(shape)

    stage, compiled = _compile(fold_and_back)
    with torch.no_grad():
        for n in NON_BUCKET_COUNTS:
            x = torch.randn(n, H)
            with ppcompile.counters.expect(replays=1):
                torch.testing.assert_close(compiled(x), stage(x))


def test_a_final_state_of_a_scan_is_read_at_the_live_count() -> None:
    """The scan is graphed; its last row (a final state) is a side output that would see padded rows in
    the graph, so the select runs eagerly on the live rows."""
    stage, compiled = _compile(lambda h: h + h.cumsum(0)[-1])
    with torch.no_grad():
        for n in NON_BUCKET_COUNTS:
            x = torch.randn(n, H)
            torch.testing.assert_close(compiled(x), stage(x))
    runtime = ppcompile.stage_runtimes()[-1]
    assert [r.op for r in runtime.break_reasons] == ["getitem"], runtime.describe()


def _tail_reaches_a_sum(h: torch.Tensor) -> torch.Tensor:
    return h + _conv(h, padding=2).sum(0)  # every output row of a causal conv, its tail too


def test_a_causal_conv_whose_tail_is_read_runs_eagerly() -> None:
    stage, compiled = _compile(_tail_reaches_a_sum)
    with torch.no_grad():
        for n in NON_BUCKET_COUNTS:
            x = torch.randn(n, H)
            torch.testing.assert_close(compiled(x), stage(x))
    reasons = [str(r) for r in ppcompile.stage_runtimes()[-1].break_reasons]
    assert any("conv1d makes rows past the live ones" in r and "sum" in r for r in reasons), reasons


def test_without_the_tail_check_padding_reaches_live_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check has teeth: a graphed causal conv's last two rows read the bucket's padded rows, and the
    sum over its rows (eager, on the live count's rows) sees them."""
    monkeypatch.setattr(check_padding_safety, "escaping_tails", lambda *args: {})
    stage, compiled = _compile(lambda h: torch.relu(_tail_reaches_a_sum(h) + 1))
    with torch.no_grad():
        x = torch.randn(5, H)
        assert not torch.allclose(compiled(x), stage(x), atol=1e-4)

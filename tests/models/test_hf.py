"""Hugging Face ``transformers`` decoders as ``pp_breakable`` PP stages (skipped without transformers)."""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here downloads; make sure nothing tries
transformers = pytest.importorskip("transformers")

import ppcompile  # noqa: E402
from ppcompile.models.hf import TINY_FAMILIES, HFStage, make_hf_stages, tiny_causal_lm  # noqa: E402
from ppcompile.models.hf_families import ATTENTION_KINDS, TOKEN_LOCAL_BLOCKS, layer_kind  # noqa: E402
from ppcompile.models.layers import PPMissingLayer  # noqa: E402
from ppcompile.records import BreakKind  # noqa: E402
from ppcompile.runtime.stage_runtime import StageRuntime  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SIZES = [4, 8, 16]
OPTIONS = {"capture_sizes": SIZES, "graph_mode": "emulate"}  # the graph path ("auto" is live-size on CPU)
EAGER_ATTENTION = ("gpt_oss", "gemma2")  # transformers has no SDPA path for them: attention in plain ops
# Families whose linear-attention / Mamba layers break once, at the mixer (a library region); LFM2's short
# causal conv is prefix-causal and stays in graphs.
MIXERS = {"qwen3_next": "Qwen3NextGatedDeltaNet", "bamba": "BambaMixer", "mamba2": "Mamba2Mixer",
          "granitemoehybrid": "GraniteMoeHybridMambaLayer", "falcon_h1": "FalconH1Mixer",
          "zamba2": "Zamba2MambaMixer", "jamba": "JambaMambaMixer"}


pytestmark = pytest.mark.usefixtures("fresh_dynamo", "one_thread")


@pytest.fixture
def new_runtimes() -> Callable[[], list[StageRuntime]]:
    """The stage runtimes built since the test started (earlier tests' may still be alive)."""
    old = ppcompile.stage_runtimes()
    return lambda: [rt for rt in ppcompile.stage_runtimes() if not any(rt is o for o in old)]


def _model(family: str, **overrides: object) -> torch.nn.Module:
    if getattr(transformers, TINY_FAMILIES[family][0], None) is None:
        pytest.skip(f"transformers {transformers.__version__} has no {TINY_FAMILIES[family][0]}")
    return tiny_causal_lm(family, num_hidden_layers=2, **overrides)


def _compile(
    model: torch.nn.Module, varlen: bool = False, declare_regions: bool = True
) -> list[torch.nn.Module]:
    return [
        torch.compile(s, backend="pp_breakable", dynamic=True, options=OPTIONS)
        for s in make_hf_stages(model, 2, varlen=varlen, declare_regions=declare_regions)
    ]


def _pipeline(stages: list[torch.nn.Module], ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    proxies = stages[0](ids, positions)
    return stages[1](None, positions, pp_proxy_tensors=proxies)  # type: ignore[no-any-return]


def _marked_pipeline(
    stages: list[torch.nn.Module], ids: torch.Tensor, positions: torch.Tensor, mark: bool
) -> torch.Tensor:
    """``_pipeline``; with ``mark``, the token dims of the inputs and of the proxies are marked dynamic
    before each stage first sees them (the first call)."""
    if mark:
        ppcompile.mark_token_dynamic(ids, positions)
    proxies = stages[0](ids, positions)
    if mark:
        ppcompile.mark_token_dynamic(proxies)
    return stages[1](None, positions, pp_proxy_tensors=proxies)  # type: ignore[no-any-return]


def _ids(n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n))


def _reasons(runtimes: list[StageRuntime], kind: BreakKind) -> str:
    return " | ".join(str(r) for rt in runtimes for r in rt.break_reasons if r.kind is kind)


def test_inductor_segments_replay_around_sdpa() -> None:
    """SDPA returns ``[B, heads, T, dim]`` laid out token-major; the bridge buffer after it keeps that
    layout, so the Inductor segment reading it replays every bucket (it used to fail capture)."""
    model = _model("llama")
    options = {**OPTIONS, "segment_compiler": "inductor"}
    stages = [torch.compile(s, backend="pp_breakable", options=options) for s in make_hf_stages(model, 2)]
    with torch.inference_mode(), ppcompile.counters.expect(replays=6, eager_runs=0):
        for n in (8, 9, 3):  # exactly a bucket, a bucket + 1, padded into the smallest
            ids, positions = _ids(n), torch.arange(n)
            logits = _marked_pipeline(stages, ids, positions, mark=n == 8)  # the first call marks
            torch.testing.assert_close(logits, model(ids[None]).logits[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_stages_match_eager_and_follow_the_bucket_plan(
    family: str, new_runtimes: Callable[[], list[StageRuntime]]
) -> None:
    model = _model(family)
    stages = _compile(model)
    with torch.inference_mode():
        # The first call compiles both stages with a symbolic token count; 8 is a bucket.
        with ppcompile.counters.expect(replays=2, eager_runs=0, replays_by_bucket={8: 2}):
            logits = _pipeline(stages, _ids(8), torch.arange(8))
        torch.testing.assert_close(logits, model(_ids(8)[None]).logits[0], rtol=1e-5, atol=1e-5)
        plan = ppcompile.stage_runtimes()[-1].plan
        assert [plan.bucket(n) for n in (3, 8, 9, 20)] == [4, 8, 16, None]
        # A bucket + 1, padding into the smallest bucket, above the cap; then 1 token, which Dynamo
        # specialises: a new graph with concrete sizes, whose calls the symbolic graph serves.
        for n in (9, 3, 20, 1, 1):
            ids, positions = _ids(n), torch.arange(n)
            bucket = plan.bucket(n)
            expected = (
                {"replays": 2, "eager_runs": 0, "replays_by_bucket": {bucket: 2}}
                if bucket is not None else {"replays": 0, "eager_runs": 2}
            )
            with ppcompile.counters.expect(**expected):
                logits = _pipeline(stages, ids, positions)
            assert logits.shape == (n, model.config.vocab_size)
            ref = model(ids[None]).logits[0]
            torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5, msg=f"{family}, {n} tokens")
    graphed = [rt for rt in new_runtimes() if rt.eager_reason is None]
    assert len(graphed) == 2
    static = [rt for rt in new_runtimes() if rt.token_symbol is None]
    assert len(static) == 2 and all(rt.served_by is not None for rt in static)  # the 1-token graphs
    _check_breaks(family, model, graphed)


def _break_table() -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """docs/hf.md, "Breaks per stage graph": family -> (layer kind of stage 0 and 1, break segments of each
    stage graph) of the 2-layer tiny model cut in two."""
    section = (ROOT / "docs" / "hf.md").read_text().split("\n## Breaks per stage graph\n", 1)[1]
    found = re.search(r"(?:^\|.*\|\n)+", section.split("\n## ", 1)[0], re.M)  # the section's first table
    assert found is not None, "docs/hf.md: no table under 'Breaks per stage graph'"
    table = {}
    for row in found.group(0).splitlines()[2:]:
        families, kinds, breaks = (cell.strip() for cell in row.strip("|").split("|")[:3])
        for family in re.findall(r"`(\w+)`", families):
            table[family] = (tuple(re.findall(r"`(\w+)`", kinds)), tuple(int(b) for b in breaks.split(",")))
    return table


def _check_breaks(family: str, model: torch.nn.Module, graphed: list[StageRuntime]) -> None:
    """The stage graphs' breaks equal docs/hf.md's table and are what each layer kind makes: SDPA (or
    attention in plain ops, one folded break) per attention layer, one library region per mixer, one
    capture-unsafe break per sparse-MoE block (declared token-local; in float32 its experts run
    grouped_mm_fallback, which reads its offsets on the host), nothing else; so at most attention and
    mixer layers + 1 per stage graph."""
    kinds, counts = _break_table()[family]
    assert kinds == tuple(layer_kind(model.config, i) for i in range(2)), "docs/hf.md is stale: layer kinds"
    assert counts == tuple(len(rt.break_reasons) for rt in graphed), \
        f"docs/hf.md is stale: {family} measured " + " / ".join(rt.describe() for rt in graphed)
    layers: Any = model.base_model.layers
    for i, (rt, kind) in enumerate(zip(graphed, kinds)):
        attention, mixer = int(kind in ATTENTION_KINDS), int(kind in ("linear_attention", "conv", "hybrid"))
        assert len(rt.break_reasons) <= attention + mixer + 1, rt.describe()
        sdpa = [r for r in rt.break_reasons if r.kind is BreakKind.ATTENTION]
        unsafe = [r for r in rt.break_reasons if r.kind is BreakKind.UNSAFE_OP]
        regions = [r for r in unsafe if "library region: " in r.op]
        moe = [s for s in rt.segments if s.reason is not None and s.reason.kind is BreakKind.CAPTURE_UNSAFE]
        plain = family in EAGER_ATTENTION  # attention in plain ops: one folded padding-unsafe break
        assert [r.op for r in sdpa] == ["scaled_dot_product_attention"] * (0 if plain else attention)
        assert len(unsafe) - len(regions) == (attention if plain else 0), rt.describe()
        assert len(regions) == (mixer if family in MIXERS else 0), rt.describe()
        assert all(f".{MIXERS[family]})" in r.op for r in regions), rt.describe()
        assert len(moe) == sum(type(m).__name__ in TOKEN_LOCAL_BLOCKS for m in layers[i].modules())
        assert all(s.token_local_regions and "grouped_mm_fallback" in s.reason.op  # type: ignore[union-attr]
                   for s in moe), rt.describe()
        assert len(rt.break_reasons) == len(sdpa) + len(unsafe) + len(moe), rt.describe()


def test_the_break_table_lists_every_family() -> None:
    assert sorted(_break_table()) == sorted(TINY_FAMILIES)


@pytest.mark.parametrize("graph_mode", ["eager", "none"])
@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss", "qwen3_next", "zamba2", "jamba"])
def test_moe_and_hybrid_families_match_eager_on_every_path(family: str, graph_mode: str) -> None:
    """The static-buffer path and the live path (the emulation: the test above) equal eager at a bucket,
    off buckets and above the cap; Qwen3-Next's chunked linear attention passes sizes such as
    ``(64 - n % 64) % 64`` and shapes between segments, Zamba2 a second proxy (the embeddings), Jamba's
    mixers are opaque ops."""
    model = _model(family)
    options = {**OPTIONS, "graph_mode": graph_mode}
    stages = [torch.compile(s, backend="pp_breakable", options=options) for s in make_hf_stages(model, 2)]
    with torch.inference_mode():
        for i, n in enumerate((8, 9, 3, 20)):
            ids, positions = _ids(n), torch.arange(n)
            logits = _marked_pipeline(stages, ids, positions, mark=i == 0)
            ref = model(ids[None]).logits[0]
            torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5, msg=f"{family}, {n} tokens")
    assert ppcompile.counters.replays == (6 if graph_mode == "eager" else 0)


def test_batched_mm_experts_break_only_at_token_folds(new_runtimes: Callable[[], list[StageRuntime]]) -> None:
    model = _model("qwen3_moe", experts_implementation="batched_mm")
    stages = _compile(model, declare_regions=False)
    with torch.inference_mode():
        for n in (8, 5):
            ids = _ids(n)
            with ppcompile.counters.expect(replays=2):
                logits = _pipeline(stages, ids, torch.arange(n))
            torch.testing.assert_close(logits, model(ids[None]).logits[0], rtol=1e-5, atol=1e-5)
    unsafe = _reasons(new_runtimes(), BreakKind.UNSAFE_OP).split(" | ")
    assert unsafe and all(re.search(r"repeat_interleave|reshape|view", r) for r in unsafe), unsafe


@pytest.mark.parametrize("family", ["qwen3_moe", "granitemoehybrid", "jamba"])
def test_undeclared_moe_blocks_break_once_each(
    family: str, new_runtimes: Callable[[], list[StageRuntime]]
) -> None:
    """Without declarations (a user's own wrapper), each library sparse-MoE block is one break."""
    model = _model(family)
    stages = _compile(model, declare_regions=False)
    with torch.inference_mode():
        for n in (8, 5, 1, 20):
            ids = _ids(n)
            logits = _pipeline(stages, ids, torch.arange(n))
            torch.testing.assert_close(logits, model(ids[None]).logits[0], rtol=1e-5, atol=1e-5)
    blocks = [m for m in model.modules() if type(m).__name__ in TOKEN_LOCAL_BLOCKS]
    assert blocks
    symbolic = [rt for rt in new_runtimes() if rt.token_symbol is not None]
    moe_breaks = [r for rt in symbolic for r in rt.break_reasons if "library region" in r.op
                  and any(name in r.op for name in TOKEN_LOCAL_BLOCKS)]
    assert len(moe_breaks) == len(blocks), [str(r) for rt in symbolic for r in rt.break_reasons]
    assert ppcompile.counters.replays > 0


def test_sliding_window_mask_is_graphed_and_bridged() -> None:
    model = _model("mistral", sliding_window=4)
    stages = _compile(model)
    with torch.inference_mode():
        for n in (9, 3, 8):  # past the window: a [T, T] mask bridged to SDPA; below it: is_causal
            ids = _ids(n)
            with ppcompile.counters.expect(replays=2):
                logits = _pipeline(stages, ids, torch.arange(n))
            torch.testing.assert_close(logits, model(ids[None]).logits[0], rtol=1e-5, atol=1e-5)
        # The window matters: the same weights without it give other logits at 9 tokens.
        full = _model("mistral")
        assert not torch.allclose(full(_ids(9)[None]).logits[0], model(_ids(9)[None]).logits[0])


def test_varlen_packs_sequences_through_hf_packed_mask(
    new_runtimes: Callable[[], list[StageRuntime]],
) -> None:
    model = _model("llama")
    stages = _compile(model, varlen=True)
    with torch.inference_mode():
        for lens in ([3, 5], [2, 2, 2, 3], [8]):
            ids = _ids(sum(lens))
            positions = torch.cat([torch.arange(n) for n in lens])
            ref = torch.cat([model(part[None]).logits[0] for part in ids.split(lens)])
            with ppcompile.counters.expect(replays=2):
                logits = _pipeline(stages, ids, positions)
            torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5, msg=str(lens))
    # HF's mask builders given positions: the packed-sequence detection (a diff over positions reads the
    # next row) and the gathers by position mix rows; the builders are one library region, so the whole
    # mask is one break per stage graph, before the first layer, not a break per row-mixing op.
    for rt in new_runtimes():
        masks = [r for r in rt.break_reasons if r.kind is BreakKind.UNSAFE_OP]
        assert len(masks) == 1 and "transformers attention masks (masking_utils)" in masks[0].op, \
            rt.describe()
        assert "diff" in masks[0].op and "cumsum" in masks[0].op


def test_eager_attention_is_reported_not_fatal(new_runtimes: Callable[[], list[StageRuntime]]) -> None:
    model = _model("qwen3", attn_implementation="eager")
    stages = _compile(model)
    with torch.inference_mode():
        for n in (8, 6):
            ids = _ids(n)
            with ppcompile.counters.expect(replays=2):
                logits = _pipeline(stages, ids, torch.arange(n))
            torch.testing.assert_close(logits, model(ids[None]).logits[0], rtol=1e-5, atol=1e-5)
    unsafe = _reasons(new_runtimes(), BreakKind.UNSAFE_OP)
    assert "softmax" in unsafe and "matmul" in unsafe
    assert not _reasons(new_runtimes(), BreakKind.ATTENTION)


def test_stage_layout_keeps_global_layer_numbering() -> None:
    model = tiny_causal_lm("llama", num_hidden_layers=5)
    stages = make_hf_stages(model, 3)
    assert [(s.start_layer, s.end_layer) for s in stages] == [(0, 1), (1, 3), (3, 5)]
    middle = stages[1]
    assert middle.embed_tokens is None and middle.norm is None and middle.lm_head is None
    assert middle.layers[2] is model.model.layers[2]
    assert isinstance(middle.layers[0], PPMissingLayer) and isinstance(middle.layers[4], PPMissingLayer)
    keys = set().union(*(s.state_dict() for s in stages))
    hf_keys = {k.removeprefix("model.") for k in model.state_dict() if k != "lm_head.weight"}
    assert keys - {"lm_head.weight"} == hf_keys
    custom = HFStage(model, 0, 2, layer_range=(0, 4))
    assert (custom.start_layer, custom.end_layer) == (0, 4)


def test_bad_input_errors_name_the_input() -> None:
    model = tiny_causal_lm("llama", num_hidden_layers=2)
    first, last = make_hf_stages(model, 2)
    with pytest.raises(ValueError, match="needs input_ids"):
        first(None, torch.arange(3))
    with pytest.raises(ValueError, match="'hidden_states'"):
        last(None, torch.arange(3), {"residual": torch.zeros(3, 64)})
    with pytest.raises(ValueError, match="pp_rank"):
        HFStage(model, 2, 2)
    with pytest.raises(ValueError, match="layer_range"):
        HFStage(model, 0, 1, layer_range=(1, 5))
    with pytest.raises(TypeError, match="ForCausalLM"):
        HFStage(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown family"):
        tiny_causal_lm("gpt2")


def test_import_error_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "ppcompile.models.hf")
    with pytest.raises(ImportError, match=r"ppcompile\[hf\]"):
        importlib.import_module("ppcompile.models.hf")


def test_docs_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    text = (ROOT / "docs" / "hf.md").read_text()
    example = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "tiny_causal_lm" in b)
    exec(compile(example, "docs/hf.md", "exec"), {})
    out = capsys.readouterr().out
    assert " 16 tokens: 2 of 2 stages replayed graphs" in out
    assert " 40 tokens: 0 of 2 stages replayed graphs" in out


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_layers_as_nested_regions_trace_once_and_match(family: str) -> None:
    """``compile_regions=True``: each HF decoder layer is a nested compile region (Dynamo traces one),
    inlined by the backend: the same breaks and results as the flat trace."""
    if getattr(transformers, TINY_FAMILIES[family][0], None) is None:
        pytest.skip(f"transformers {transformers.__version__} has no {TINY_FAMILIES[family][0]}")
    model = tiny_causal_lm(family, num_hidden_layers=4)
    flat = make_hf_stages(model, 2)
    stages = [torch.compile(s, backend="pp_breakable", options=OPTIONS)
              for s in make_hf_stages(model, 2, compile_regions=True)]
    with torch.inference_mode():
        for i, n in enumerate((8, 9, 3, 20)):  # a bucket (first call), bucket + 1, padded, above the cap
            ids, positions = _ids(n), torch.arange(n)
            logits = _marked_pipeline(stages, ids, positions, mark=i == 0)
            torch.testing.assert_close(logits, _pipeline(flat, ids, positions), rtol=1e-5, atol=1e-5)
    assert ppcompile.counters.replays == 6  # 8, 9 and 3 tokens through both stages; 20 is above the cap
    graphed = [rt for rt in ppcompile.stage_runtimes()[-2:] if rt.eager_reason is None]
    assert len(graphed) == 2
    for rt in graphed:
        attention = [r for r in rt.break_reasons if r.kind is BreakKind.ATTENTION]
        assert len(attention) == 2  # two layers per stage, each split at its attention once inlined


@pytest.mark.slow
def test_hybrid_stages_equal_eager_at_every_token_count() -> None:
    """Qwen3-Next (chunked linear attention padding to 64, MoE) at every count from 1 to past the cap:
    every size that crosses segments is evaluated where it is read, whatever the count's residue."""
    model = _model("qwen3_next")
    options = {"capture_sizes": [16, 32, 64], "graph_mode": "emulate"}
    stages = [torch.compile(s, backend="pp_breakable", options=options) for s in make_hf_stages(model, 2)]
    with torch.inference_mode():
        for n in range(1, 80):
            ids, positions = _ids(n), torch.arange(n)
            # 1 token is always a static graph: the first dynamic trace is marked at 16.
            logits = _marked_pipeline(stages, ids, positions, mark=n == 16)
            torch.testing.assert_close(logits, model(ids[None]).logits[0], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=n: f"{n} tokens: {m}")
    # Counts from 9 to 64 whose bucket pads at most 2x take the graph path in both stages.
    assert ppcompile.counters.replays >= 2 * (64 - 9)


# State-space families with a chunk of 4 tokens, so that the tested counts cross its residue classes.
SMALL_CHUNKS = {"mamba2": {"chunk_size": 4}, "zamba2": {"chunk_size": 4}, "bamba": {"mamba_chunk_size": 4},
                "falcon_h1": {"mamba_chunk_size": 4}, "granitemoehybrid": {"mamba_chunk_size": 4}}


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "qwen3_next", *SMALL_CHUNKS, "jamba"])
def test_each_stage_spends_at_most_two_compiles_from_one_token_to_above_the_cap(
    family: str, new_runtimes: Callable[[], list[StageRuntime]]
) -> None:
    """Marked token dims: per stage one symbolic stage graph and one for a single token, whatever the
    count (for the Mamba-2 families, whatever its residue modulo the chunk: their mixers are opaque); the
    two stages (instances of one class, one Dynamo frame) are told apart from recompiles."""
    model = _model(family, **SMALL_CHUNKS.get(family, {}))
    stages = [torch.compile(s, backend="pp_breakable", options=OPTIONS) for s in make_hf_stages(model, 2)]
    flat = make_hf_stages(model, 2)
    with torch.inference_mode():
        for n in (5, 1, 4, 8, 9, 16, 17, 3, 12, 2, 15, 33):
            ids, positions = _ids(n), torch.arange(n)
            logits = _marked_pipeline(stages, ids, positions, mark=True)
            torch.testing.assert_close(logits, _pipeline(flat, ids, positions), rtol=1e-4, atol=1e-4)
    runtimes = new_runtimes()
    by_module: dict[int | None, list[StageRuntime]] = {}
    for rt in runtimes:
        by_module.setdefault(rt.compiled.record.module, []).append(rt)
    assert sorted(by_module) == [1, 2] and all(len(rts) == 2 for rts in by_module.values()), \
        [rt.label for rt in runtimes]
    for first, one_token in by_module.values():
        assert one_token.token_symbol is None and one_token.compiled.record.recompile_of == first.name
    assert by_module[2][0].label.endswith("(module 2 of its frame)")

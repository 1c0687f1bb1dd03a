"""``HFStage`` across the ``transformers`` families: stages compose to the model, Zamba2's embeddings proxy,
Jamba's opaque mixers, the families and configurations it refuses; and HF models in a wrapper of your
own, whose mask builders and mixers are library regions (skipped without transformers).

Every family of ``TINY_FAMILIES`` is also compiled and checked against eager and against docs/hf.md's
break table in ``test_hf.py::test_stages_match_eager_and_follow_the_bucket_plan``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here downloads; make sure nothing tries
transformers = pytest.importorskip("transformers")

import ppcompile  # noqa: E402
from ppcompile.models import hf  # noqa: E402
from ppcompile.models.hf import TINY_FAMILIES, HFStage, make_hf_stages, tiny_causal_lm  # noqa: E402
from ppcompile.records import BreakKind  # noqa: E402

OPTIONS = {"capture_sizes": [4, 8, 16], "graph_mode": "emulate"}


pytestmark = pytest.mark.usefixtures("fresh_dynamo", "one_thread")


def _model(family: str, **overrides: Any) -> torch.nn.Module:
    if getattr(transformers, TINY_FAMILIES[family][0], None) is None:
        pytest.skip(f"transformers {transformers.__version__} has no {TINY_FAMILIES[family][0]}")
    return tiny_causal_lm(family, **overrides)


def _ids(n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n))


def _run(stages: list[torch.nn.Module], ids: torch.Tensor, mark: bool = False) -> torch.Tensor:
    """The stages in a chain; with ``mark``, every stage's token dims are marked before its call."""
    positions = torch.arange(len(ids))
    if mark:
        ppcompile.mark_token_dynamic(ids, positions)
    out: Any = stages[0](ids, positions)
    for stage in stages[1:]:
        if mark:
            ppcompile.mark_token_dynamic(out)
        out = stage(None, positions, pp_proxy_tensors=out)
    return out  # type: ignore[no-any-return]


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_eager_stages_of_every_family_compose_to_the_model(family: str) -> None:
    """Three stages of a 4-layer model (1, 1 and 2 layers) equal the HF model: embedding and logit
    multipliers, per-kind masks and rotary embeddings, Zamba2's embeddings proxy through a middle stage."""
    model = _model(family, num_hidden_layers=4)
    ids = _ids(11)
    with torch.inference_mode():
        torch.testing.assert_close(_run(make_hf_stages(model, 3), ids), model(ids[None]).logits[0])


def test_zamba2_stages_pass_the_embeddings_on() -> None:
    """Zamba2's hybrid layers read the embeddings: every stage but the last returns them as the
    ``original_hidden_states`` proxy, the middle one passes its input on; compiled, the stages equal the
    model at a bucket, a bucket + 1, padded and above the cap. Layers 1 and 3 (stages 1 and 2) share the
    weights of one attention block."""
    model = _model("zamba2", num_hidden_layers=4)
    stages = make_hf_stages(model, 3)
    blocks = [stages[1].layers[1].shared_transformer, stages[2].layers[3].shared_transformer]
    assert blocks[0].self_attn.q_proj.weight is blocks[1].self_attn.q_proj.weight
    compiled = [torch.compile(s, backend="pp_breakable", options=OPTIONS) for s in stages]
    with torch.inference_mode():
        first = compiled[0](_ids(8), torch.arange(8))
        assert sorted(first) == ["hidden_states", "original_hidden_states"]
        for i, n in enumerate((8, 9, 3, 20)):
            ids = _ids(n)
            torch.testing.assert_close(_run(compiled, ids, mark=i == 0), model(ids[None]).logits[0],
                                       rtol=1e-5, atol=1e-5, msg=lambda m, n=n: f"{n} tokens: {m}")
    assert ppcompile.counters.replays >= 9  # 8, 9 and 3 tokens through three stages
    with pytest.raises(ValueError, match="'original_hidden_states'"):
        stages[1](None, torch.arange(3), {"hidden_states": torch.zeros(3, 64)})


def test_opaque_mixers_keep_their_models_apart() -> None:
    """Jamba's mixers run through one opaque op (``ppcompile.opaque_module``) keyed by the mixer: two
    models of the same class, compiled as one-stage pipelines, each equal their own model (the second
    recompiles, never reusing the first's mixers); the HF model with a cache still runs its mixers as
    before."""
    models = [_model("jamba", num_hidden_layers=2, seed=seed) for seed in (0, 1)]
    stages = [HFStage(m) for m in models]
    compiled = [torch.compile(s, backend="pp_breakable", options=OPTIONS) for s in stages]
    with torch.inference_mode():
        for i, n in enumerate((8, 5, 20)):
            ids = _ids(n)
            for model, stage in zip(models, compiled):
                want = model(ids[None], use_cache=True).logits[0]
                torch.testing.assert_close(_run([stage], ids, mark=i == 0), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(models[0](_ids(8)[None]).logits, models[1](_ids(8)[None]).logits)
    for stage in stages:
        (rt,) = [rt for rt in ppcompile.runtimes_of(stage) if rt.token_symbol is not None]
        assert sum("ppcompile.opaque_module" in r.op for r in rt.break_reasons) == 1, rt.describe()


def test_families_and_configurations_it_cannot_serve_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    llama = tiny_causal_lm("llama", num_hidden_layers=2)
    monkeypatch.setitem(hf.UNSUPPORTED, "llama", "a reason")
    with pytest.raises(ValueError, match=r"family 'llama'\) is not supported: a reason"):
        HFStage(llama)
    monkeypatch.delitem(hf.UNSUPPORTED, "llama")
    # Mixers carry state along the tokens: packed sequences would leak into each other.
    with pytest.raises(ValueError, match=r"varlen=True .*'bamba'.*carry state"):
        make_hf_stages(_model("bamba", num_hidden_layers=2), 2, varlen=True)
    HFStage(_model("bamba", num_hidden_layers=2), 1, 2, varlen=True)  # its attention stage packs fine
    chunked = tiny_causal_lm("llama", num_hidden_layers=2)
    chunked.config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"'llama'.*\['chunked_attention'\]"):
        HFStage(chunked, 0, 2)


# ---------------------------------------------------------------------------------- a wrapper of your own
# 2-layer models made from their transformers configs, compiled whole in a user's batch-first wrapper.
_SMALL: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
_SSM_MAMBA2: dict[str, Any] = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16,
                               "mamba_n_groups": 1, "mamba_chunk_size": 16, "mamba_expand": 2}
# family -> (config class, fields, the mixer class's name, mixer breaks in a 2-layer model: LFM2's short
# causal conv is prefix-causal and stays in graphs, no break)
_SSM_FAMILIES: dict[str, tuple[str, dict[str, Any], str, int]] = {
    "mamba2": ("Mamba2Config", {"num_heads": 8, "head_dim": 16, "state_size": 16, "n_groups": 1,
                                "chunk_size": 16, "expand": 2, "conv_kernel": 4}, "Mamba2Mixer", 2),
    "bamba": ("BambaConfig", {**_SSM_MAMBA2, "attn_layer_indices": [1], "attn_implementation": "sdpa"},
              "BambaMixer", 1),
    "granitemoehybrid": ("GraniteMoeHybridConfig", {**_SSM_MAMBA2, "layer_types": ["mamba", "attention"],
                                                    "num_local_experts": 2, "num_experts_per_tok": 1,
                                                    "attn_implementation": "sdpa"},
                         "GraniteMoeHybridMambaLayer", 1),
    "zamba2": ("Zamba2Config", {"layers_block_type": ["mamba", "hybrid"], "mamba_d_state": 16,
                                "mamba_headdim": 16, "n_mamba_heads": 8, "mamba_ngroups": 1,
                                "chunk_size": 16, "attn_implementation": "sdpa"}, "Zamba2MambaMixer", 2),
    "lfm2": ("Lfm2Config", {"layer_types": ["conv", "full_attention"], "attn_implementation": "sdpa"},
             "Lfm2ShortConv", 0),
}


def _from_config(class_name: str, **fields: Any) -> torch.nn.Module:
    """A seeded random-weight causal LM of transformers' ``class_name`` config (skips if it is missing)."""
    if getattr(transformers, class_name, None) is None:
        pytest.skip(f"transformers {transformers.__version__} has no {class_name}")
    config = getattr(transformers, class_name)(**fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config).eval()  # type: ignore[no-any-return]


class _UserWrapper(torch.nn.Module):
    """A stage wrapper as a new user writes one: the HF model itself, batch-first, given position_ids
    (which HF's mask builders use to look for packed sequences)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, position_ids=positions, use_cache=False).logits  # type: ignore


_MASK_FAMILIES = {"llama": ("LlamaConfig", {}), "gemma3": ("Gemma3TextConfig", {"sliding_window": 4}),
                  "cohere": ("CohereConfig", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
                  "granite": ("GraniteConfig", {})}


@pytest.mark.parametrize("family", sorted(_MASK_FAMILIES))
def test_hf_mask_code_given_positions_is_one_break_per_stage_graph(family: str) -> None:
    """A user's wrapper passes position_ids, so HF's mask builders run their packed-sequence detection
    and position gathers (row-mixing: 2-5 breaks before): one break per stage graph now, beside the
    attention breaks; logits equal eager at a bucket, a bucket + 1, below and above the cap."""
    class_name, extra = _MASK_FAMILIES[family]
    model = _UserWrapper(_from_config(class_name, **{**_SMALL, "head_dim": 16, "attn_implementation": "sdpa",
                                                     **extra}))
    compiled = torch.compile(model, backend="pp_breakable", options=OPTIONS)
    with torch.inference_mode():
        for n in (8, 9, 3, 20):
            ids, positions = _ids(n)[None], torch.arange(n)[None]
            ppcompile.mark_token_dynamic(ids, positions, dim=1)
            torch.testing.assert_close(compiled(ids, positions), model(ids, positions), rtol=1e-5, atol=1e-5)
    (rt,) = [rt for rt in ppcompile.runtimes_of(model) if rt.token_symbol is not None]
    others = [r for r in rt.break_reasons if r.kind is not BreakKind.ATTENTION]
    assert len(others) == 1 and "transformers attention masks (masking_utils)" in others[0].op, rt.describe()
    assert ppcompile.counters.replays == 3  # 20 tokens is above the cap



class _BatchFirstLM(torch.nn.Module):
    """A user's stage wrapper: the HF model on ``[1, T]`` ids, no cache."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits  # type: ignore[no-any-return]


@pytest.mark.parametrize("family", sorted(_SSM_FAMILIES))
def test_a_state_space_or_short_conv_mixer_is_one_break(family: str) -> None:
    """HF's torch reference mixers (a chunked SSD scan, a short causal conv) may mix token rows all
    through; each mixer instance is one library region: one break run on the live rows if any of its
    ops must break (4-7 breaks per layer before), else in graphs. Logits equal eager at a bucket, a
    bucket + 1, below and above the cap."""
    class_name, fields, mixer, mixer_breaks = _SSM_FAMILIES[family]
    model = _BatchFirstLM(_from_config(class_name, **_SMALL, **fields))
    compiled = torch.compile(model, backend="pp_breakable", options=OPTIONS)
    with torch.inference_mode():
        for n in (8, 9, 3, 20):
            ids = _ids(n)[None]
            ppcompile.mark_token_dynamic(ids, dim=1)
            torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-4, atol=1e-4)
    graphs = [rt for rt in ppcompile.runtimes_of(model) if rt.token_symbol is not None]
    assert graphs and ppcompile.counters.replays == 3  # 20 tokens is above the cap
    for rt in graphs:
        ops = [r.op for r in rt.break_reasons]
        assert sum("library region: " in op and f".{mixer})" in op for op in ops) == mixer_breaks, \
            rt.describe()


class _StatesOut(torch.nn.Module):
    """The HF model with a cache, returning the logits and every layer's conv and SSM states."""

    def __init__(self, model: torch.nn.Module, layers: int) -> None:
        super().__init__()
        self.model, self.layers = model, layers

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.model(input_ids=ids, use_cache=True)
        cache = out.cache  # type: ignore[attr-defined]
        states = [t for i in range(self.layers)
                  for t in (cache.get_conv_state(i), cache.get_recurrent_state(i))]
        return (out.logits, *states)


def test_the_states_a_mixer_writes_for_decode_equal_eager() -> None:
    """The conv and SSM states a Mamba-2 mixer leaves for decode never see padded rows: the mixer runs
    on the live rows (one break), so on the graph path they equal eager's at every count."""
    class_name, fields, _, _ = _SSM_FAMILIES["mamba2"]
    model = _StatesOut(_from_config(class_name, **_SMALL, **fields), 2)
    compiled = torch.compile(model, backend="pp_breakable", options=OPTIONS)
    with torch.inference_mode():
        for n in (8, 9, 3, 16, 5):
            ids = _ids(n)[None]
            ppcompile.mark_token_dynamic(ids, dim=1)
            got, want = compiled(ids), model(ids)
            assert len(got) == 5 and all(t is not None for t in want)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=lambda m, n=n: f"{n} tokens: {m}")
    assert ppcompile.counters.replays == 5

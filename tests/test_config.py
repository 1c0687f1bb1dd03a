"""Tests of ``PPBreakableConfig``: defaults, validation of every key, the cap, the hash, the env var."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest
import torch

from ppcompile.config import (
    DEFAULT_MAX_CAPTURE_TOKENS,
    PPBreakableConfig,
    graph_path_mode,
    live_mode_reason,
    resolve_graph_mode,
)

FIELDS = [f.name for f in dataclasses.fields(PPBreakableConfig)]


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PPCOMPILE_DUMP_DIR", raising=False)
    configs = (PPBreakableConfig(), PPBreakableConfig.from_options(None), PPBreakableConfig.from_options({}))
    for config in configs:
        assert config.capture_sizes is None
        assert config.max_capture_tokens == DEFAULT_MAX_CAPTURE_TOKENS == 8192
        assert config.cap == 8192
        assert config.split_ops == ()
        assert config.segment_compiler == "eager"
        assert config.graph_mode == "auto"
        assert config.max_padding_factor == 2.0
        assert config.dump_dir is None
        assert config.debug is False and config.owned_outputs is True  # copies: right for every caller
        assert config.output_slots == 1


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        PPBreakableConfig().debug = True  # type: ignore[misc]


def test_unknown_key_lists_valid_keys() -> None:
    with pytest.raises(ValueError, match="capture_size") as info:
        PPBreakableConfig.from_options({"capture_size": [16]})
    for name in FIELDS:
        assert name in str(info.value)


GOOD: dict[str, list[Any]] = {
    "capture_sizes": [[1], (16, 32), [8, 8, 4]],
    "max_capture_tokens": [1, 2048],
    "split_ops": [[], ["aten::relu"], (torch.relu, "a::b")],
    "segment_compiler": ["eager", "inductor"],
    "compile_sizes": [[], ()],  # non-empty needs segment_compiler="inductor": tests/backends
    "dedup_segments": [True, False],
    "inductor_config": [{}],  # non-empty needs segment_compiler="inductor": below
    "graph_mode": ["auto", "cuda", "emulate", "eager", "none"],
    "max_padding_factor": [1, 1.0, 4.5],
    "dump_dir": [None, "/tmp/dumps"],
    "debug": [True, False],
    "owned_outputs": [True, False, None],
    "output_slots": [1, 2, 8],
    "on_unsafe": ["break", "error"],
    "token_local_ops": [[], ["mylib::rowwise"], (torch.relu,)],
    "fold_graph_ops": [0, 3, 100],
    "whole_graph_tokens": [0, 64, 512],
    "copy_kernel": ["auto", "triton", "torch"],
    "capture": ["all", "lazy"],
    "capture_budget_s": [None],  # a number needs capture="lazy": below
    "collective_ops": [[], ["mylib::all_reduce"], ("mylib::all_reduce", "mylib::all_reduce_")],
    "tp_group": [None],  # a process group: tests/runtime/test_tensor_parallel.py (spawned ranks)
}
BAD: dict[str, list[Any]] = {
    "capture_sizes": [[], [0], [-4], [16, "32"], [2.0], [True], "16", 16, {16}],
    "max_capture_tokens": [0, -1, 1.5, "8192", True, None],
    "split_ops": ["aten::relu", ["relu"], ["a::b::c"], ["::relu"], ["aten::"], 3],
    "segment_compiler": ["tvm", "Eager", None],
    "compile_sizes": [[16], [0], [-2], ["16"], [True], [1.5], 16, "16", None],
    "dedup_segments": [1, "yes", None],
    "inductor_config": [{"cpp_wrapper": True}, ["cpp_wrapper"], None, {1: True}],  # eager compiler
    "graph_mode": ["graphs", "CUDA", None],
    "max_padding_factor": [0.5, 0, -2.0, float("nan"), "2", True, None],
    "dump_dir": [3, b"/tmp"],
    "debug": [1, "yes", None],
    "owned_outputs": [0, "no", 1],
    "output_slots": [0, -1, 1.5, "2", True, None],
    "on_unsafe": ["eager", "Error", None],
    "token_local_ops": ["mylib::rowwise", ["rowwise"], 3],
    "fold_graph_ops": [-1, 1.5, "3", True, None],
    "whole_graph_tokens": [-1, 2.5, "64", True, None],
    "copy_kernel": ["cuda", None, 1],
    "capture": ["eager", "Lazy", None],
    "capture_budget_s": [0, -1.0, "5", True, 5.0],  # 5.0: needs capture="lazy"
    "collective_ops": ["mylib::all_reduce", ["all_reduce"], 3],
    "tp_group": ["world", 0, object()],
}


def test_a_capture_budget_goes_with_lazy_capture() -> None:
    config = PPBreakableConfig.from_options({"capture": "lazy", "capture_budget_s": 2.5})
    assert config.capture == "lazy" and config.capture_budget_s == 2.5


def test_every_field_has_cases() -> None:
    assert sorted(GOOD) == sorted(FIELDS) == sorted(BAD)


@pytest.mark.parametrize(("key", "value"), [(k, v) for k, vs in GOOD.items() for v in vs])
def test_good_values(key: str, value: Any) -> None:
    PPBreakableConfig.from_options({key: value})


@pytest.mark.parametrize(("key", "value"), [(k, v) for k, vs in BAD.items() for v in vs])
def test_bad_values_name_the_key(key: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"option '{key}'"):
        PPBreakableConfig.from_options({key: value})


def test_capture_sizes_sorted_deduplicated_and_cap_is_max() -> None:
    config = PPBreakableConfig.from_options({"capture_sizes": [64, 16, 32, 16], "max_capture_tokens": 8})
    assert config.capture_sizes == (16, 32, 64)
    assert config.cap == 64  # explicit sizes override max_capture_tokens
    assert PPBreakableConfig(capture_sizes=[3, 1]).capture_sizes == (1, 3)  # type: ignore[arg-type]
    assert PPBreakableConfig.from_options({"max_capture_tokens": 1000}).cap == 1000


def test_inductor_config_names_real_inductor_settings() -> None:
    patches = {"cpp_wrapper": True, "triton.cudagraphs": False}
    config = PPBreakableConfig.from_options({"segment_compiler": "inductor", "inductor_config": patches})
    assert config.inductor_config == patches
    plain = PPBreakableConfig.from_options({"segment_compiler": "inductor"})
    assert config.compute_hash() != plain.compute_hash()
    typo = {"segment_compiler": "inductor", "inductor_config": {"cpp_wraper": True}}
    with pytest.raises(ValueError, match=r"option 'inductor_config'.*\['cpp_wraper'\] are not settings"):
        PPBreakableConfig.from_options(typo)


def test_split_ops_become_a_tuple() -> None:
    config = PPBreakableConfig.from_options({"split_ops": ["aten::relu"]})
    assert config.split_ops == ("aten::relu",)


def test_compute_hash_is_stable_and_tracks_fields() -> None:
    base = PPBreakableConfig.from_options({"capture_sizes": [16, 32]})
    same = PPBreakableConfig.from_options({"capture_sizes": [32, 16, 16]})
    assert base.compute_hash() == same.compute_hash()
    assert len(base.compute_hash()) == 16
    changed = {
        "capture_sizes": [16, 64],
        "max_capture_tokens": 4096,
        "split_ops": ["aten::relu"],
        "segment_compiler": "inductor",
        "graph_mode": "emulate",
        "max_padding_factor": 3.0,
        "debug": True,
        "owned_outputs": False,
    }
    hashes = {base.compute_hash()}
    for key, value in changed.items():
        h = PPBreakableConfig.from_options({"capture_sizes": [16, 32], key: value}).compute_hash()
        assert h not in hashes, key
        hashes.add(h)
    # Where dumps go does not change what is compiled.
    dumped = PPBreakableConfig.from_options({"capture_sizes": [16, 32], "dump_dir": "/tmp/x"})
    assert dumped.compute_hash() == base.compute_hash()


def test_compute_hash_of_op_objects_is_stable_across_processes() -> None:
    """A hash keyed on ``str(op)`` of a builtin would contain its memory address."""
    ops = (torch.relu, torch.ops.aten.relu, torch.ops.aten.relu.default)
    here = PPBreakableConfig(split_ops=ops).compute_hash()
    code = ("import torch; from ppcompile.config import PPBreakableConfig; print(PPBreakableConfig(split_ops="
            "(torch.relu, torch.ops.aten.relu, torch.ops.aten.relu.default)).compute_hash())")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert there.strip() == here


def test_dump_dir_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPCOMPILE_DUMP_DIR", "/tmp/from_env")
    assert PPBreakableConfig.from_options({}).dump_dir == "/tmp/from_env"
    assert PPBreakableConfig.from_options({"dump_dir": "/tmp/given"}).dump_dir == "/tmp/given"
    assert PPBreakableConfig.from_options({"dump_dir": None}).dump_dir is None  # explicit wins
    monkeypatch.setenv("PPCOMPILE_DUMP_DIR", "")
    assert PPBreakableConfig.from_options({}).dump_dir is None


def test_graph_path_mode_is_cuda_graphs_on_cuda_and_their_emulation_elsewhere() -> None:
    assert graph_path_mode("cuda") == "cuda"
    assert graph_path_mode("cpu") == graph_path_mode("meta") == "emulate"


# ------------------------------------------------------------------ graph_mode="auto" and its resolution
# The backend picks the fastest correct mode for the device the stage runs on: CUDA graphs for CUDA
# tensors; anywhere else the live-size path ("none"), which on CPU beats the emulation of graphs (copy-in,
# padding and output copies with no launches to save; docs/benchmarks.md). The end-to-end checks are
# tests/runtime/test_stage_runtime.py (auto on CPU serves like "none") and
# tests/runtime/test_cuda_graphs_gpu.py (auto on a GPU captures CUDA graphs).
def test_auto_is_the_live_path_on_cpu() -> None:
    assert resolve_graph_mode("auto", on_cuda=False) == "none"


def test_auto_is_cuda_graphs_for_cuda_tensors() -> None:
    assert resolve_graph_mode("auto", on_cuda=True, cuda_available=True) == "cuda"


def test_auto_is_the_live_path_for_cpu_tensors_on_a_gpu_machine() -> None:
    assert resolve_graph_mode("auto", on_cuda=False, cuda_available=True) == "none"


def test_auto_is_the_live_path_when_cuda_is_unavailable() -> None:
    assert resolve_graph_mode("auto", on_cuda=True, cuda_available=False) == "none"


def test_auto_asks_torch_whether_cuda_is_available_when_not_told() -> None:
    expected = "cuda" if torch.cuda.is_available() else "none"
    assert resolve_graph_mode("auto", on_cuda=True) == expected


@pytest.mark.parametrize("mode", ["emulate", "eager", "none"])
def test_an_explicit_mode_is_kept_on_any_device(mode: str) -> None:
    assert resolve_graph_mode(mode, on_cuda=False, cuda_available=True) == mode
    assert resolve_graph_mode(mode, on_cuda=True, cuda_available=True) == mode


def test_explicit_cuda_on_cpu_tensors_names_the_modes_that_work() -> None:
    with pytest.raises(ValueError, match="not on a CUDA device") as info:
        resolve_graph_mode("cuda", on_cuda=False)
    assert "'auto'" in str(info.value) and "'emulate'" in str(info.value)


def test_the_live_mode_reason_says_what_was_asked() -> None:
    assert live_mode_reason("none").startswith("graph_mode='none':")
    assert "'auto' off CUDA resolves to graph_mode='none'" in live_mode_reason("auto")


def test_output_slots_beyond_one_refuse_owned_outputs() -> None:
    with pytest.raises(ValueError, match=r"output_slots.*owned_outputs=True"):
        PPBreakableConfig.from_options({"output_slots": 2, "owned_outputs": True})
    PPBreakableConfig.from_options({"output_slots": 1, "owned_outputs": True})


def test_owned_outputs_default_to_copies_unless_a_ring_is_asked_for() -> None:
    assert PPBreakableConfig.from_options({}).owned_outputs is True
    assert PPBreakableConfig.from_options({"owned_outputs": None}).owned_outputs is True
    assert PPBreakableConfig.from_options({"output_slots": 2}).owned_outputs is False  # views into the ring
    assert PPBreakableConfig.from_options({"owned_outputs": False}).owned_outputs is False
    assert PPBreakableConfig.from_options({"output_slots": 3, "owned_outputs": False}).owned_outputs is False

"""``graph_mode="auto"``: the backend picks the fastest correct mode for the device the stage runs on.

CUDA graphs for CUDA tensors; anywhere else the live-size path (``"none"``), which on CPU beats the
emulation of graphs (copy-in, padding and output copies with no launches to save; docs/benchmarks.md).
The end-to-end checks are ``tests/runtime/test_stage_runtime.py`` (auto on CPU serves like ``"none"``) and
``tests/runtime/test_cuda_graphs_gpu.py`` (auto on a GPU captures CUDA graphs).
"""

from __future__ import annotations

import pytest
import torch

from ppcompile.backends.pp_breakable import _resolve_graph_mode
from ppcompile.config import PPBreakableConfig


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on a CUDA device: all the resolution reads of an example input."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def _cuda_input() -> torch.Tensor:
    return torch.zeros(4, 8).as_subclass(_OnCuda)


def test_auto_is_the_live_path_on_cpu() -> None:
    assert _resolve_graph_mode(PPBreakableConfig(), [torch.zeros(4, 8), 3]) == "none"


def test_auto_is_cuda_graphs_for_cuda_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _resolve_graph_mode(PPBreakableConfig(), [torch.zeros(2), _cuda_input(), 3]) == "cuda"


def test_auto_is_the_live_path_for_cpu_tensors_on_a_gpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _resolve_graph_mode(PPBreakableConfig(), [torch.zeros(4, 8)]) == "none"


def test_auto_is_the_live_path_when_cuda_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _resolve_graph_mode(PPBreakableConfig(), [_cuda_input()]) == "none"


@pytest.mark.parametrize("mode", ["emulate", "eager", "none"])
def test_an_explicit_mode_is_kept_on_any_device(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = PPBreakableConfig(graph_mode=mode)
    assert _resolve_graph_mode(config, [torch.zeros(4, 8)]) == mode
    assert _resolve_graph_mode(config, [_cuda_input()]) == mode


def test_explicit_cuda_on_cpu_tensors_names_the_modes_that_work() -> None:
    with pytest.raises(ValueError, match="not on a CUDA device") as info:
        _resolve_graph_mode(PPBreakableConfig(graph_mode="cuda"), [torch.zeros(4, 8)])
    assert "'auto'" in str(info.value) and "'emulate'" in str(info.value)

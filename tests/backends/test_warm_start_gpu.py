"""ppcompile.warm_compile on a CUDA device: a restart reads the stored lowered stage back (with Inductor
segments, their Triton kernels from the stored cache artifacts) and captures and replays real CUDA
graphs, equal to eager across token counts.

Skipped without CUDA (tests/backends/test_warm_start.py covers the same path on CPU, emulated)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ppcompile
from ppcompile.backends.segment_compilers import clear_segment_cache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

H = 64


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(H, 4 * H), torch.nn.Linear(4 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("segment_compiler", ["eager", "inductor"])
def test_a_restart_on_cuda_replays_graphs_and_matches_eager(
        segment_compiler: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPCOMPILE_CACHE_DIR", str(tmp_path))
    stage = Block().cuda()
    options = {"capture_sizes": [4, 8, 16], "segment_compiler": segment_compiler}
    x = torch.randn(6, H, device="cuda")
    ppcompile.mark_token_dynamic(x)
    with torch.no_grad():
        ppcompile.warm_compile(stage, options)(x)
        torch._dynamo.reset()
        clear_segment_cache()
        again = ppcompile.warm_compile(stage, options)
        for n in (6, 4, 16, 17):  # the traced count, a bucket, the cap, above it (eager)
            y = torch.randn(n, H, device="cuda")
            torch.testing.assert_close(again(y), stage(y), atol=1e-4, rtol=1e-4)
    assert (again.loaded, again.compiled) == (1, 0)
    assert [set(rt.compiled.record.compile_times) for rt in again.runtimes()] == [{"read_back"}]
    assert ppcompile.counters.replays >= 3

"""A compiled reference stage with dumps on, shared by the tests of ``ppcompile.debug``."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch

import ppcompile
from ppcompile.models import (
    REFERENCE_CONFIGS,
    make_batch,
    make_forward_context,
    make_stage,
    set_forward_context,
)
from ppcompile.runtime.stage_runtime import StageRuntime

SIZES = [4, 8, 16, 32]


@dataclasses.dataclass
class Stage:
    """Stage ``rank`` of a ``pp``-stage split of a reference model, compiled with ``pp_breakable``."""

    cfg_name: str
    rank: int
    pp: int
    module: torch.nn.Module
    compiled: Any

    def call(self, n: int, seed: int = 0, compiled: bool = True) -> Any:
        cfg = REFERENCE_CONFIGS[self.cfg_name]
        ids, pos, proxies = make_batch(cfg, [n], self.rank, self.pp, seed=seed)
        ctx = make_forward_context([n], cfg, range(self.module.start_layer, self.module.end_layer))
        fn = self.compiled if compiled else self.module
        with torch.inference_mode(), set_forward_context(ctx):
            out = fn(ids, pos, pp_proxy_tensors=proxies)
        if isinstance(out, torch.Tensor):
            return out.clone()
        return {k: v.clone() for k, v in out.items()}

    @property
    def runtime(self) -> StageRuntime:
        return ppcompile.stage_runtimes()[-1]


def compile_stage(options: dict[str, Any], cfg_name: str = "tiny", rank: int = 1, pp: int = 4) -> Stage:
    """Compiles the stage (lazily: Dynamo compiles at the first call), with the graph path's emulation
    unless ``options`` name another graph mode: dumps and reports of the graph path are what these tests
    read, and ``"auto"`` serves the live path on CPU."""
    module = make_stage(REFERENCE_CONFIGS[cfg_name], rank, pp)
    compiled = torch.compile(module, backend="pp_breakable", dynamic=True,
                             options={"capture_sizes": SIZES, "graph_mode": "emulate", **options})
    return Stage(cfg_name, rank, pp, module, compiled)


def read_report(folder: str) -> dict[str, Any]:
    with open(os.path.join(folder, "report.json"), encoding="utf-8") as f:
        return json.load(f)  # type: ignore[no-any-return]

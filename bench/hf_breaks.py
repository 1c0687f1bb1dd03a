"""Breaks per decoder layer of the tiny ``transformers`` families as ``pp_breakable`` stages.

The first stage of a 4-layer model cut in two (layers 0 and 1), compiled with marked token dims and
``capture_sizes=[16, 32, 64]``; one forward at 16 tokens. Counts break segments per layer, with what
each break is. ``--no-regions`` leaves the MoE blocks and linear-attention scans undeclared
(``HFStage(declare_regions=False)``); ``--fold N`` sets ``fold_graph_ops``.

Run alone: ``python bench/hf_breaks.py [--no-regions] [--fold N]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

import ppcompile
from ppcompile.models.hf import TINY_FAMILIES, make_hf_stages, tiny_causal_lm

__all__ = ["first_stage_breaks"]


def first_stage_breaks(family: str, declare_regions: bool, fold: int | None) -> tuple[int, Counter[str]]:
    """(break segments of stage 0 (two layers), their kinds) for ``family``."""
    torch._dynamo.reset()
    model = tiny_causal_lm(family)
    stage = make_hf_stages(model, 2, declare_regions=declare_regions)[0]
    options: dict[str, object] = {"capture_sizes": [16, 32, 64]}
    if fold is not None:
        options["fold_graph_ops"] = fold
    compiled = torch.compile(stage, backend="pp_breakable", options=options)
    ids, positions = torch.randint(0, 256, (16,)), torch.arange(16)
    ppcompile.mark_token_dynamic(ids, positions)
    with torch.inference_mode():
        compiled(ids, positions)
    runtime = ppcompile.stage_runtimes()[-1]
    reasons = runtime.break_reasons
    return len(reasons), Counter(r.kind.value for r in reasons)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--no-regions", action="store_true")
    parser.add_argument("--fold", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| family | breaks per layer | kinds (stage of 2 layers) |")
    print("|---|---|---|")
    for family in TINY_FAMILIES:
        count, kinds = first_stage_breaks(family, not args.no_regions, args.fold)
        what = ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items()))
        print(f"| {family} | {count / 2:g} | {what} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

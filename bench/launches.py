"""Ops the runtime launches outside graph segments per forward, by kind (issue 16's launch count).

A 3-layer middle PP stage of the reference decoder (live inputs: positions, hidden states, residual),
once with functional attention (it returns a fresh tensor, which the runtime copies into a static bridge
per layer) and once with the out-variant op (it writes into a tensor the graph allocated: no bridge).
One forward of 100 tokens (bucket 128) is profiled with ``torch.profiler`` through the runtime's
``instrumented`` hook, which puts a ``record_function`` range around each part; what runs inside a
graph replay is excluded. Counted per kind: ``copy-in`` (live inputs into static buffers, padding rows
zeroed), ``bridge copies`` (break outputs into static bridges), ``break ops`` (the break segments' own
ops: attention), and ``runtime, other`` (anything else the runtime launches: output trims, checks).

* CPU (``graph_mode`` ``emulate`` and ``eager``): ATen ops that do work, i.e. the innermost ATen calls
  that are not views or metadata (``copy_``, ``fill_``, a kernel), as a GPU would launch them.
* CUDA (``graph_mode="cuda"``): kernel launches, memcpys and memsets (CUDA runtime and driver calls),
  excluding the graph launches themselves.

Each with ``copy_kernel="torch"`` (a ``copy_`` and a ``zero_`` per tensor) and ``"triton"`` (one fused
launch per copy point; on CPU under Triton's interpreter, where a copier call is counted as its launch).

Run alone: ``python bench/launches.py [--device cpu|cuda] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import ppcompile
from bench.report import markdown_table, save_json
from ppcompile.models import ModelConfig, make_batch, make_forward_context, make_stage, set_forward_context

__all__ = ["count_launches", "run_launches"]

STAGE = ModelConfig(num_layers=9)  # rank 1 of 3: layers 3..5
TOKENS = [40, 60]  # 100 tokens, bucket 128
KINDS = ("copy-in", "bridge copies", "break ops", "runtime, other")
_RANGE = "ppcompile-runtime/"
_KIND_OF = {"copy-in": "copy-in", "bridge copies": "bridge copies", "break segments": "break ops"}
# Ops that only make views or read metadata: no kernel on a GPU.
_FREE = frozenset(("aten::narrow", "aten::slice", "aten::as_strided", "aten::view", "aten::select",
                   "aten::reshape", "aten::_reshape_alias", "aten::unsqueeze", "aten::squeeze",
                   "aten::transpose", "aten::t", "aten::permute", "aten::expand", "aten::alias",
                   "aten::detach", "aten::empty", "aten::empty_like", "aten::empty_strided",
                   "aten::resolve_conj", "aten::resolve_neg", "aten::lift_fresh", "aten::item",
                   "aten::_local_scalar_dense", "aten::is_nonzero", "aten::result_type"))
_CUDA_LAUNCHES = ("LaunchKernel", "Memcpy", "Memset")


_CALLS: Counter[str] = Counter()  # calls of each wrapped part (a fused copier call is one launch)


def _wrap(category: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    label = _RANGE + category

    def ranged(*args: Any, **kwargs: Any) -> Any:
        _CALLS[category] += 1
        with record_function(label):
            return fn(*args, **kwargs)

    return ranged


def _kind(event: Any) -> str | None:
    """The runtime part an event ran in (None: inside a graph replay), from its enclosing ranges."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(_RANGE):
            category = parent.name[len(_RANGE):]
            return None if category == "graph replays" else _KIND_OF.get(category, "runtime, other")
        parent = parent.cpu_parent
    return "runtime, other"


def _launches_cpu(events: Sequence[Any]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for e in events:
        if not e.name.startswith("aten::") or e.name in _FREE:
            continue
        if any(c.name.startswith("aten::") and c.name not in _FREE for c in e.cpu_children):
            continue  # not the innermost op doing work
        kind = _kind(e)
        if kind is not None:
            counts[kind] += 1
    return counts


def _launches_cuda(events: Sequence[Any]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for e in events:
        if any(k in e.name for k in _CUDA_LAUNCHES) and not e.name.startswith(("aten::", _RANGE)):
            kind = _kind(e)
            if kind is not None:
                counts[kind] += 1
    return counts


def count_launches(compiled: Any, runtime: Any, forward: Callable[[], Any], device: str) -> Counter[str]:
    """Launches outside graph replays during one ``forward()`` of ``compiled`` (whose runtime is
    ``runtime``), by kind."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with runtime.instrumented(_wrap):
        forward()  # generates the instrumented code outside the profile
        if device == "cuda":
            torch.cuda.synchronize()
        _CALLS.clear()
        with profile(activities=activities) as prof:
            with record_function(_RANGE + "forward"):
                forward()
            if device == "cuda":
                torch.cuda.synchronize()
    events = list(prof.events())
    if device == "cuda":
        return _launches_cuda(events)
    counts = _launches_cpu(events)
    if runtime.instances()[0].copy_kernel == "triton":  # Triton's CPU interpreter runs no ATen ops
        for kind in ("copy-in", "bridge copies"):
            counts[kind] = _CALLS[kind]
    return counts


def _stage_runtime() -> Any:
    runtimes = [rt for rt in ppcompile.stage_runtimes() if rt.token_symbol is not None]
    if not runtimes:
        raise RuntimeError("launches: the compiled stage built no symbolic StageRuntime")
    return runtimes[-1]


def run_launches(device: str, variants: Sequence[tuple[str, str]]) -> list[dict[str, Any]]:
    """Counts per (attention kind, ``(graph_mode, copy_kernel)`` of ``variants``)."""
    rows = []
    for attention in ("functional", "out-variant"):
        cfg = STAGE.replace(attention_with_output=attention == "out-variant")
        for mode, copy_kernel in variants:
            torch._dynamo.reset()
            stage = make_stage(cfg, 1, 3, device)
            _, pos, proxies = make_batch(cfg, TOKENS, 1, 3, device=device)
            assert proxies is not None
            ppcompile.mark_token_dynamic(pos, proxies)
            ctx = make_forward_context(TOKENS, cfg, range(cfg.num_layers), device=device)
            options: dict[str, Any] = {"graph_mode": mode, "capture_sizes": [64, 128],
                                       "copy_kernel": copy_kernel}
            compiled = torch.compile(stage, backend="pp_breakable", options=options)

            def forward(compiled: Any = compiled, pos: torch.Tensor = pos, proxies: Any = proxies,
                        ctx: Any = ctx) -> Any:
                with torch.inference_mode(), set_forward_context(ctx):
                    return compiled(None, pos, proxies)

            forward()  # compile and capture
            runtime = _stage_runtime()
            counts = count_launches(compiled, runtime, forward, device)
            breaks = sum(1 for st in runtime.program.steps if not st.segment.is_graph)
            rows.append({"attention": attention, "graph_mode": mode, "copy_kernel": copy_kernel,
                         "breaks": breaks,
                         "live_inputs": len(runtime.program.input_buffers),
                         "bridges": len(runtime.program.bridge_buffers),
                         **{k: counts.get(k, 0) for k in KINDS}})
    return rows


def markdown(rows: list[dict[str, Any]], device: str) -> str:
    unit = "kernel launches, memcpys and memsets" if device == "cuda" else "ATen ops doing work"
    table = markdown_table(
        ["attention", "graph mode", "copy kernel", "breaks", "live inputs", "bridges", *KINDS],
        [[r["attention"], r["graph_mode"], r["copy_kernel"], r["breaks"], r["live_inputs"], r["bridges"],
          *(r[k] for k in KINDS)] for r in rows])
    return (f"Outside graph replays, per forward ({unit}; {sum(TOKENS)} tokens, bucket 128, a 3-layer "
            f"middle stage on {device}):\n\n{table}\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        variants = [("cuda", "torch"), ("cuda", "triton")]
    else:  # the fused copier under Triton's interpreter: counted as calls, one launch each
        os.environ.setdefault("TRITON_INTERPRET", "1")
        variants = [("emulate", "torch"), ("eager", "torch"), ("emulate", "triton")]
    torch.set_num_threads(1)
    rows = run_launches(device, variants)
    save_json(args.out / f"launches-{device}.json", {"device": device, "rows": rows})
    print(markdown(rows, device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

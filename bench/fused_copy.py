"""Copy-in at one copy point: per-tensor torch ops (``copy_`` + ``zero_`` per tensor) against the fused Triton
row copy (``ppcompile.runtime.fused_copy``: one launch for all tensors).

``k`` tensors of ``[n, hidden]`` bf16 (k = 1, 4, 16; n = 100, 1000, 5000; hidden 4096) are copied into static
buffers of the largest bucket (8192 rows), zeroing the padding rows up to the bucket ``b`` that the default
capture ladder gives ``n``. Per configuration and path:

* host us per call: from the call to its return, the GPU idle before each call (synchronised, untimed), so
  it is what launching costs the host; median of ``--calls`` calls, the two paths interleaved;
* wall us per call: ``--calls`` calls back to back between two CUDA events, divided by the calls (the GPU's
  copy time when it is the bottleneck, the host's when that is);
* launches per call: CUDA kernels ``torch.profiler`` records for one call.

Needs CUDA; elsewhere it says so and exits 0 (``--dry-run`` runs tiny sizes on CPU through Triton's
interpreter to exercise this script; its figures mean nothing).

Run alone: ``python bench/fused_copy.py [--calls 200] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

__all__ = ["run_fused_copy"]

HIDDEN = 4096
MAX_TOKENS = 8192
KS = (1, 4, 16)
NS = (100, 1000, 5000)


def _bucket(n: int, max_tokens: int) -> int:
    from ppcompile.config import default_capture_ladder

    return min(b for b in default_capture_ladder(max_tokens) if b >= n)


def _launches(copier: Any, args: tuple[Any, ...], device: torch.device) -> int | None:
    """CUDA kernels one call launches (None on CPU: the profiler sees no kernels there)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        copier(*args)
        torch.cuda.synchronize(device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _wall_us(copier: Any, args: tuple[Any, ...], device: torch.device, calls: int) -> float:
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(calls):
            copier(*args)
        return (time.perf_counter() - start) / calls * 1e6
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    begin.record()
    for _ in range(calls):
        copier(*args)
    end.record()
    torch.cuda.synchronize(device)
    return begin.elapsed_time(end) / calls * 1e3


def run_fused_copy(device: torch.device, ks: Sequence[int], ns: Sequence[int], hidden: int, max_tokens: int,
                   calls: int) -> list[dict[str, Any]]:
    """One row per (k, n): host and wall us per call and launches per call, torch ops and fused copy."""
    from ppcompile.runtime.fused_copy import make_row_copier

    def buffers(k: int) -> list[torch.Tensor]:
        return [torch.zeros(max_tokens, hidden, dtype=torch.bfloat16, device=device) for _ in range(k)]

    rows = []
    for k in ks:
        copiers = {"torch": make_row_copier(buffers(k), [0] * k, kernel="torch"),
                   "triton": make_row_copier(buffers(k), [0] * k, kernel="triton")}
        for n in ns:
            b = _bucket(n, max_tokens)
            srcs = [torch.randn(n, hidden, device=device).to(torch.bfloat16) for _ in range(k)]
            args = (srcs, [n] * k, [b] * k)
            for copier in copiers.values():  # compile, see the layouts
                for _ in range(3):
                    copier(*args)
            host: dict[str, list[float]] = {name: [] for name in copiers}
            gc.disable()
            try:
                for _ in range(calls):
                    for name, copier in copiers.items():
                        if device.type == "cuda":
                            torch.cuda.synchronize(device)
                        start = time.perf_counter()
                        copier(*args)
                        host[name].append((time.perf_counter() - start) * 1e6)
            finally:
                gc.enable()
            row: dict[str, Any] = {"k": k, "n": n, "b": b}
            for name, copier in copiers.items():
                row[f"{name}_host_us"] = statistics.median(host[name])
                row[f"{name}_wall_us"] = _wall_us(copier, args, device, calls)
                row[f"{name}_launches"] = _launches(copier, args, device)
            ref = buffers(1)[0]
            for copier in copiers.values():
                ref.copy_(copier.dsts[-1])
                assert torch.equal(ref[:n], srcs[-1]) and not ref[n:b].any(), "copy went wrong"
            rows.append(row)
        del copiers
    return rows


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    from bench.report import markdown_table

    def fmt(x: Any) -> str:
        return "n/a" if x is None else f"{x:.1f}" if isinstance(x, float) else str(x)

    headers = ["k", "n", "bucket", "torch host us", "fused host us", "torch wall us", "fused wall us",
               "torch launches", "fused launches"]
    cells = [f"{p}_{m}" for m in ("host_us", "wall_us", "launches") for p in ("torch", "triton")]
    table = [[r["k"], r["n"], r["b"], *(fmt(r[c]) for c in cells)] for r in rows]
    return markdown_table(headers, table)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None, help="write fused_copy.json and fused_copy.md here")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU (Triton's interpreter)")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the copier's kernel is made
        device, ks, ns, hidden, max_tokens, calls = torch.device("cpu"), (1, 2), (3, 9), 8, 16, 2
    elif not torch.cuda.is_available():
        print("bench/fused_copy.py: needs a CUDA device (it times kernel launches); nothing to run here. "
              "--dry-run exercises it on CPU.")
        return 0
    else:
        device, ks, ns, hidden, max_tokens = torch.device("cuda"), KS, NS, HIDDEN, MAX_TOKENS
        calls = args.calls
    try:
        import triton  # noqa: F401
    except ImportError:
        print("bench/fused_copy.py: triton is not importable; nothing to compare")
        return 0
    from bench.report import describe_machine, machine_info, save_json

    info = machine_info(device)
    rows = run_fused_copy(device, ks, ns, hidden, max_tokens, calls)
    text = (f"Copy-in of k [n, {hidden}] bf16 tensors into [{max_tokens}, {hidden}] buffers, zeroing up to "
            f"the bucket: per-tensor torch ops vs one fused Triton launch ({describe_machine(info)}).\n\n"
            f"{markdown(rows)}\n")
    print(text)
    if args.out is not None:
        save_json(args.out / "fused_copy.json", {"machine": info, "rows": rows})
        (args.out / "fused_copy.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

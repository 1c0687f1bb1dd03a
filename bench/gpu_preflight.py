"""What a GPU machine offers before anything long runs on it: the first step of ``bench/gpu_check.sh``.

Checks, each independent (one that raises is recorded with its error and the next still runs):

* ``versions``: Python, torch (and its CUDA), Triton.
* ``cuda_device``: the device torch sees (name, compute capability, memory).
* ``c_compiler``: ``$CC``, ``cc``, ``gcc`` or ``clang`` on ``PATH`` (Triton builds its launcher with one).
* ``python_headers``: ``Python.h`` in ``sysconfig.get_paths()["include"]`` (the same build needs it).
* ``test_deps``: what the GPU tests import besides torch (pytest, hypothesis, numpy).
* ``fused_copy``: one small copier from ``make_row_copier(kernel="auto")``, called once and checked: which
  kind it ended up as and its launch path; on CUDA, when ``auto`` fell back to torch ops, one
  ``kernel="triton"`` copier is tried to record why.
* ``cuda_graph``: one tiny capture through ``ppcompile.torch_internals.cuda_graph_capture`` under
  ``torch.cuda.set_sync_debug_mode("error")``, then a replay on new input and its numbers checked.
* ``nccl_graph``: a one-rank NCCL process group (in-memory store), one warm-up all-reduce, then an
  in-place ``all_reduce`` and an out-of-place ``all_gather_into_tensor`` captured the same way, replayed
  on new input and checked; the phase that failed (init, warm_up, capture, replay) is recorded. Then the
  graph is freed and the group destroyed (a check of at most ``NCCL_DESTROY_S`` seconds).

On ``--device cpu`` the CUDA-only checks are recorded as skipped. The results go to ``--out`` (JSON),
rewritten after every check, so a crash leaves what was found (and which check was running). Exit code 1
when a check failed, else 0.

Run alone: ``python bench/gpu_preflight.py [--device auto|cpu|cuda] [--out preflight.json]``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import json
import logging
import os
import platform
import shutil
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

__all__ = ["CHECKS", "CUDA_ONLY", "run_checks"]

Details = dict[str, Any]
NCCL_DESTROY_S = 10.0


class CheckFailed(RuntimeError):
    """A failed check that still has findings to record (``details``)."""

    def __init__(self, message: str, details: Details) -> None:
        super().__init__(message)
        self.details = details


def _versions(device: torch.device) -> Details:
    info: Details = {"python": platform.python_version(), "torch": torch.__version__,
                     "torch_cuda": torch.version.cuda, "triton": None}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError as e:
        info["triton_error"] = str(e)
    return info


def _cuda_device(device: torch.device) -> Details:
    if not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device")
    props = torch.cuda.get_device_properties(device)
    return {"name": props.name, "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1), "count": torch.cuda.device_count()}


def _c_compiler(device: torch.device) -> Details:
    env_cc = os.environ.get("CC")
    found = {name: shutil.which(name) for name in ("cc", "gcc", "clang")}
    info: Details = {"CC": env_cc, **found}
    if not (env_cc and shutil.which(env_cc)) and not any(found.values()):
        raise RuntimeError("no C compiler: $CC unset or not found, and no cc, gcc or clang on PATH")
    return info


def _python_headers(device: torch.device) -> Details:
    include = Path(sysconfig.get_paths()["include"])
    header = include / "Python.h"
    if not header.is_file():
        raise RuntimeError(f"no Python.h in {include} (install the Python development headers)")
    return {"include": str(include)}


def _test_deps(device: torch.device) -> Details:
    versions: Details = {}
    missing = []
    for name in ("pytest", "hypothesis", "numpy"):
        try:
            versions[name] = getattr(importlib.import_module(name), "__version__", "?")
        except ImportError:
            missing.append(name)
            versions[name] = None
    if missing:
        raise RuntimeError(f"not importable: {', '.join(missing)} (the test files importing them fail to "
                           "collect)")
    return versions


class _Warnings(logging.Handler):
    """Keeps the messages of the warnings logged while it is attached."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _copy_once(device: torch.device, kernel: str) -> tuple[Any, list[str]]:
    """A copier over two buffers, called once (5 live rows, bucket 8) and its result checked."""
    from ppcompile.runtime import fused_copy

    hidden = torch.full((16, 4), -1.0, device=device)
    positions = torch.full((16,), -1, dtype=torch.int64, device=device)
    caught = _Warnings()
    logger = logging.getLogger(fused_copy.__name__)
    logger.addHandler(caught)
    try:
        copier = fused_copy.make_row_copier([hidden, positions], dims=[0, 0], kernel=kernel)
    finally:
        logger.removeHandler(caught)
    src_h = torch.arange(20, dtype=torch.float32, device=device).reshape(5, 4)
    src_p = torch.arange(5, dtype=torch.int64, device=device)
    copier([src_h, src_p], [5, 5], [8, 8])
    expect_h = torch.cat([src_h, torch.zeros(3, 4, device=device), torch.full((8, 4), -1.0, device=device)])
    expect_p = torch.cat([src_p, torch.zeros(3, dtype=torch.int64, device=device),
                          torch.full((8,), -1, dtype=torch.int64, device=device)])
    if not (torch.equal(hidden, expect_h) and torch.equal(positions, expect_p)):
        raise RuntimeError(f"the {copier.kernel} copier wrote wrong values: {hidden.tolist()}, "
                           f"{positions.tolist()}")
    return copier, caught.messages


def _fused_copy(device: torch.device) -> Details:
    copier, warnings = _copy_once(device, "auto")
    info: Details = {"auto_kind": copier.kernel, "launch_path": copier.launch_path,
                     "compiles": copier.compiles, "fallback_warnings": warnings}
    if device.type != "cuda":
        info["triton"] = "skipped: auto picks torch ops off CUDA"
        return info
    info["triton_worked"] = copier.kernel == "triton"
    if copier.kernel != "triton":  # why: the same copy with kernel="triton", which raises instead
        try:
            triton_copier, _ = _copy_once(device, "triton")
            info["triton_alone"] = f"worked ({triton_copier.launch_path}) though auto fell back"
        except Exception as e:
            info["triton_error"] = f"{type(e).__name__}: {e}"
        raise CheckFailed(f"copy_kernel='auto' fell back to torch ops on CUDA: "
                          f"{info.get('triton_error') or warnings}", info)
    return info


def _cuda_graph(device: torch.device) -> Details:
    if not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device")
    from ppcompile.torch_internals import cuda_graph_capture

    with torch.cuda.device(device):
        x = torch.full((8,), 2.0, device=device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            y = x * 3 + 1  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")  # a synchronizing call during the capture raises
        try:
            with cuda_graph_capture(graph, pool, stream):
                y = x * 3 + 1
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.current_stream().wait_stream(stream)
        x.fill_(5.0)
        graph.replay()
        torch.cuda.synchronize(device)
        got = y.tolist()
    if got != [16.0] * 8:
        raise RuntimeError(f"the replay on x = 5 gave {got}; expected 16.0 everywhere")
    return {"replayed": got[0]}


def _destroy_group(seconds: float) -> str:
    """``destroy_process_group()`` in a thread: ``"ok"``, or why it did not end within ``seconds``."""
    import torch.distributed as dist

    outcome = [f"did not return in {seconds:g} s (a graph holding NCCL work alive, or a stuck collective)"]

    def destroy() -> None:
        try:
            dist.destroy_process_group()
            outcome[0] = "ok"
        except Exception as e:
            outcome[0] = f"{type(e).__name__}: {e}"

    thread = threading.Thread(target=destroy, name="destroy_process_group", daemon=True)
    thread.start()
    thread.join(seconds)
    return outcome[0]


def _nccl_graph(device: torch.device) -> Details:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        raise RuntimeError("this torch has no NCCL (torch.distributed.is_nccl_available() is False)")
    if dist.is_initialized():
        raise RuntimeError("a default process group is already initialised in this process")
    from ppcompile.torch_internals import cuda_graph_capture

    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    info: Details = {"nccl": ".".join(str(v) for v in torch.cuda.nccl.version()), "phase": "init"}
    torch.cuda.set_device(device)
    graph: Any = None
    try:
        start = time.perf_counter()
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device,
                                timeout=datetime.timedelta(seconds=20))
        info["init_s"] = round(time.perf_counter() - start, 3)
        info["phase"] = "warm_up"  # the communicator is created outside the capture
        x = torch.full((8,), 2.0, device=device)
        gathered = torch.zeros(8, device=device)
        warm = x * 3 + 1
        dist.all_reduce(warm)
        dist.all_gather_into_tensor(gathered, warm)
        torch.cuda.synchronize(device)
        info["phase"] = "capture"
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
        with cuda_graph_capture(graph, pool, stream):
            y = x * 3 + 1
            dist.all_reduce(y)  # in place: no copy for NCCL to make at one rank
            dist.all_gather_into_tensor(gathered, y)  # out of place: NCCL copies y into gathered
        torch.cuda.current_stream(device).wait_stream(stream)
        info["phase"] = "replay"
        x.fill_(5.0)
        gathered.zero_()
        graph.replay()
        torch.cuda.synchronize(device)
        got = (y.tolist(), gathered.tolist())
        if got != ([16.0] * 8, [16.0] * 8):
            raise RuntimeError(f"the replay on x = 5 gave all_reduce {got[0]}, all_gather {got[1]}; expected "
                               "16.0 everywhere")
        info["phase"] = "done"
        info["replayed"] = got[0][0]
    except Exception as e:
        raise CheckFailed(f"{info['phase']}: {type(e).__name__}: {e}", info) from e
    finally:
        graph = None  # a communicator waits for the graphs that captured its work
        gc.collect()
        if dist.is_initialized():
            info["destroy"] = _destroy_group(NCCL_DESTROY_S)
    if info.get("destroy", "ok") != "ok":
        raise CheckFailed(f"destroy_process_group: {info['destroy']}", info)
    return info


CHECKS: dict[str, Callable[[torch.device], Details]] = {
    "versions": _versions,
    "cuda_device": _cuda_device,
    "c_compiler": _c_compiler,
    "python_headers": _python_headers,
    "test_deps": _test_deps,
    "fused_copy": _fused_copy,
    "cuda_graph": _cuda_graph,
    "nccl_graph": _nccl_graph,
}
CUDA_ONLY = frozenset(("cuda_device", "cuda_graph", "nccl_graph"))


def _write(path: Path | None, record: Details) -> None:
    if path is None:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
    tmp.replace(path)  # never a half-written file, even if the process dies here


def run_checks(device: torch.device, out: Path | None = None) -> Details:
    """Runs every check on ``device``, printing a line each and rewriting ``out`` after each; returns the
    record: ``{"device", "checks": {name: {"status": ok|failed|skipped, "seconds", ...}}, "finished"}``."""
    record: Details = {"device": str(device), "checks": {}, "finished": False}
    for name, check in CHECKS.items():
        if name in CUDA_ONLY and device.type != "cuda":
            record["checks"][name] = {"status": "skipped", "reason": f"needs CUDA; device is {device}"}
            print(f"preflight: {name}: skipped (device {device})", flush=True)
            continue
        record["checks"][name] = {"status": "running"}
        _write(out, record)  # a crash inside the check leaves it marked running
        start = time.perf_counter()
        try:
            result: Details = {"status": "ok", **check(device)}
        except CheckFailed as e:
            result = {"status": "failed", "error": str(e), **e.details}
        except Exception as e:
            result = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        result["seconds"] = round(time.perf_counter() - start, 3)
        record["checks"][name] = result
        _write(out, record)
        shown = {k: v for k, v in result.items() if k not in ("status", "seconds")}
        print(f"preflight: {name}: {result['status']} in {result['seconds']:.1f} s "
              f"{json.dumps(shown, default=str)}", flush=True)
    record["finished"] = True
    _write(out, record)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--out", type=Path, default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    name = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    record = run_checks(torch.device(name), args.out)
    failed = [n for n, r in record["checks"].items() if r["status"] == "failed"]
    print(f"preflight: {len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

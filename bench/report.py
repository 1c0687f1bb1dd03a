"""Reporting for the prefill benchmarks: the machine's description, markdown tables, the sections of
``docs/benchmarks.md`` (between ``<!-- key:start -->`` / ``<!-- key:end -->`` markers, so several
writers share the file), and JSON results."""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import platform
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "describe_machine",
    "full_collections",
    "has_markdown_section",
    "load_json",
    "machine_info",
    "markdown_table",
    "not_measured",
    "save_json",
    "update_markdown_section",
]


def machine_info(device: torch.device | str, threads: int | None = None) -> dict[str, Any]:
    """Where the figures come from: platform, cores, accelerator, versions, date."""
    device = torch.device(device)
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": threads if threads is not None else torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device.type,
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    return info


def describe_machine(info: Mapping[str, Any]) -> str:
    gpu = f", GPU {info['gpu']} (CUDA {info['cuda']}, triton {info.get('triton')})" if info.get("gpu") else ""
    load = info.get("load_avg_1m")
    busy = f", load average {load:g} at the start" if load is not None else ""
    return (f"{info['date']}; {info['platform']}, {info['processor']}, {info['cpu_cores']} cores "
            f"({info['torch_threads']} torch thread(s){busy}){gpu}; Python {info['python']}, "
            f"torch {info['torch']}")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A GitHub markdown table; ``align`` is one char per column (``l``/``r``), default right but first."""
    align = align or "l" + "r" * (len(headers) - 1)
    sep = ["---:" if a == "r" else ":---" for a in align]
    lines = ["| " + " | ".join(map(str, headers)) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


def update_markdown_section(path: Path, key: str, body: str, title: str = "# Benchmarks") -> None:
    """Replaces the text between ``<!-- key:start -->`` and ``<!-- key:end -->`` in ``path`` (appends
    the section when absent; creates the file with ``title`` when missing). Other sections are kept."""
    start, end = f"<!-- {key}:start -->", f"<!-- {key}:end -->"
    block = f"{start}\n{body.strip()}\n{end}"
    text = path.read_text() if path.exists() else f"{title}\n"
    if start in text and end in text and text.index(start) < text.index(end):
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def has_markdown_section(path: Path, key: str) -> bool:
    return path.exists() and f"<!-- {key}:start -->" in path.read_text()


def save_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")


def load_json(path: Path) -> Any:
    return json.loads(path.read_text())


def not_measured(why: str) -> str:
    """The note for a benchmark path that was dropped: ``FAILED`` unless a time budget skipped it."""
    return f"not measured ({why})" if why.startswith("skipped") else f"FAILED, not measured: {why}"


@contextlib.contextmanager
def full_collections() -> Iterator[list[float]]:
    """The seconds of each full (oldest-generation) collection CPython's cycle collector runs inside, in
    a list filled as they happen: one costs a pass over the whole heap, torch's objects included, and
    lands wherever the objects made since the last one cross its threshold."""
    seconds: list[float] = []
    started: list[float] = []

    def on_collection(phase: str, info: Mapping[str, Any]) -> None:
        if info.get("generation") != 2:  # CPython's oldest generation
            return
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            seconds.append(time.perf_counter() - started.pop())

    gc.callbacks.append(on_collection)
    try:
        yield seconds
    finally:
        gc.callbacks.remove(on_collection)

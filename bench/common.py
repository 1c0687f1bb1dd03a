"""Shared pieces of the prefill benchmarks: the stage under test and its paths, varlen prefill streams,
timing, and the suites (sizes) with their command-line options. Reporting lives in ``report.py``.

A *path* is one way of running the same PP stage (same module, same weights): ``eager`` (the plain
module), ``pp_breakable`` with a given graph mode and segment compiler, or (on a GPU) torch's own
``mode="reduce-overhead"`` with Inductor graph partition around the attention op.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import ppcompile  # also registers the pp_breakable backend
from ppcompile.config import graph_path_mode
from ppcompile.models import (
    REFERENCE_CONFIGS,
    ForwardContext,
    ModelConfig,
    make_batch,
    make_forward_context,
    make_stage,
    set_forward_context,
)
from ppcompile.pipeline.inprocess import STAGE_RECOMPILE_LIMIT
from ppcompile.torch_internals import raise_recompile_limit

__all__ = [
    "ATTENTION_OP",
    "PATHS",
    "REPO_ROOT",
    "SEED_CAPS",
    "SUITES",
    "Batch",
    "PathSpec",
    "StageHarness",
    "StageSpec",
    "Suite",
    "add_suite_arguments",
    "apply_threads",
    "configure_torch_partition",
    "make_harness",
    "median",
    "parse_paths",
    "prefill_stream",
    "suite_from_args",
    "sync",
]

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
ATTENTION_OP = "ppcompile::attention"
SEED_CAPS = (2048, 4096, 8192, 16384, 32768)
"""Aggregate prefill caps of the seed's table; CPU runs divide them by a scale."""


# ------------------------------------------------------------------------------------------ paths
@dataclasses.dataclass(frozen=True)
class PathSpec:
    """One way of running the stage.

    ``kind``: ``"eager"`` (the module as is), ``"pp_breakable"`` (``options`` go to the backend) or
    ``"reduce-overhead"`` (torch's CUDA graphs with Inductor graph partition; CUDA only).
    ``graphs``: a ``pp_breakable`` path on the graph path whatever the device (CUDA graphs on a GPU,
    their emulation on CPU, where ``"auto"`` would run at the live size); ``options`` then name no
    ``graph_mode``.
    """

    name: str
    label: str
    kind: str
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    cuda_only: bool = False
    graphs: bool = False

    def backend_options(self, device: torch.device) -> dict[str, Any]:
        """``options`` with the graph mode a graph path takes on ``device``."""
        if self.graphs:
            return {**self.options, "graph_mode": graph_path_mode(device.type)}
        return dict(self.options)


PATHS: dict[str, PathSpec] = {
    p.name: p
    for p in (
        PathSpec("eager", "eager", "eager"),
        PathSpec("ppb", "pp_breakable (graphs, eager segments)", "pp_breakable",
                 {"segment_compiler": "eager"}, graphs=True),
        PathSpec("ppb-static", "pp_breakable (static buffers, no graphs)", "pp_breakable",
                 {"graph_mode": "eager", "segment_compiler": "eager"}),
        PathSpec("ppb-inductor", "pp_breakable (graphs, inductor segments)", "pp_breakable",
                 {"segment_compiler": "inductor"}, graphs=True),
        PathSpec("ppb-torch-copies", "pp_breakable (graphs, eager segments, per-tensor copies)",
                 "pp_breakable", {"segment_compiler": "eager", "copy_kernel": "torch"}, cuda_only=True,
                 graphs=True),
        PathSpec("torch-ro", "torch.compile reduce-overhead (partitioned)", "reduce-overhead",
                 cuda_only=True),
    )
}


def parse_paths(text: str, device: torch.device) -> list[PathSpec]:
    """``"eager,ppb"`` -> the named paths; CUDA-only paths are dropped on CPU with a log line."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PATHS]
    if unknown:
        raise ValueError(f"unknown benchmark path(s) {unknown}; valid: {sorted(PATHS)}")
    paths = []
    for n in names:
        if PATHS[n].cuda_only and device.type != "cuda":
            log.info("path %s needs CUDA; skipped on %s", n, device)
            continue
        paths.append(PATHS[n])
    if "eager" not in [p.name for p in paths]:
        paths.insert(0, PATHS["eager"])  # every ratio is against eager
    return paths


# ------------------------------------------------------------------------------------------ the stage
@dataclasses.dataclass(frozen=True)
class StageSpec:
    """Which reference-model stage to build; ``hidden``/``layers``/``experts`` override the preset."""

    preset: str = "small-dense"
    layers: int | None = None
    hidden: int | None = None
    experts: int | None = None
    dtype: str | None = None
    pp_size: int = 4
    pp_rank: int = 1
    device: str = "cpu"

    def model_config(self) -> ModelConfig:
        """The preset with the overrides applied; a new hidden size rescales heads and MLP widths."""
        if self.preset not in REFERENCE_CONFIGS:
            raise ValueError(f"StageSpec.preset: unknown {self.preset!r}; valid: {sorted(REFERENCE_CONFIGS)}")
        cfg = REFERENCE_CONFIGS[self.preset]
        changes: dict[str, Any] = {}
        if self.layers is not None:
            changes["num_layers"] = self.layers
        if self.hidden is not None:
            head_dim = 64 if self.hidden >= 256 else 16
            heads = max(1, self.hidden // head_dim)
            changes.update(hidden_size=self.hidden, head_dim=head_dim, num_heads=heads,
                           num_kv_heads=max(1, heads // 4) if heads % 4 == 0 else heads,
                           intermediate_size=_round_up(self.hidden * 11 // 4, 64),
                           moe_intermediate_size=max(16, self.hidden // 2))
        if self.experts is not None:
            changes["num_experts"] = self.experts
        if self.dtype is not None:
            changes["dtype"] = getattr(torch, self.dtype)
        return cfg.replace(**changes) if changes else cfg

    def describe(self) -> str:
        cfg = self.model_config()
        moe = f", {cfg.num_experts} experts top-{cfg.experts_top_k}" if cfg.num_experts else ", dense MLP"
        per_stage = cfg.num_layers // self.pp_size
        return (f"reference decoder, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
                f"{cfg.num_heads}/{cfg.num_kv_heads} heads x {cfg.head_dim}{moe}, "
                f"{str(cfg.dtype).removeprefix('torch.')}; stage {self.pp_rank} of PP{self.pp_size} "
                f"(~{per_stage} layers)")


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclasses.dataclass
class Batch:
    """One prefill forward's inputs, built ahead of timing (KV caches and metadata included)."""

    seq_lens: list[int]
    args: tuple[Any, ...]
    ctx: ForwardContext

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)


def capture_totals() -> dict[str, Any]:
    """What every live stage runtime has captured so far: graphs, buckets, seconds and the CUDA caching
    allocator's growth over the captures (``None`` off CUDA). A path's share is the difference across
    its first call (the paths share one stage module, so they cannot be told apart by it)."""
    records = [r for rt in ppcompile.stage_runtimes() for r in rt.capture_records() if r.failed is None]
    measured = [r.measured_bytes for r in records if r.measured_bytes is not None]
    return {"graphs": sum(r.graphs for r in records), "buckets": sum(len(r.buckets) for r in records),
            "seconds": sum(r.seconds for r in records), "measured_bytes": sum(measured) if measured else None}


class StageHarness:
    """One PP stage of a reference model and a compiled module per path, sharing its weights."""

    def __init__(self, spec: StageSpec, paths: Sequence[PathSpec], capture_cap: int) -> None:
        self.spec = spec
        self.cfg = spec.model_config()
        self.device = torch.device(spec.device)
        self.paths = {p.name: p for p in paths}
        self.capture_cap = capture_cap
        self.stage = make_stage(self.cfg, spec.pp_rank, spec.pp_size, self.device)
        self.layer_ids = range(self.stage.start_layer, self.stage.end_layer)
        raise_recompile_limit(STAGE_RECOMPILE_LIMIT)  # its compiled paths share one forward code object
        self.modules: dict[str, Callable[..., Any]] = {p.name: self._build(p) for p in paths}
        self.compile_seconds: dict[str, float] = {}
        self.captures: dict[str, dict[str, Any]] = {}  # pp_breakable paths: what their first call captured
        self.max_diffs: dict[str, float] = {}
        self.failed: dict[str, str] = {}

    @property
    def buckets(self) -> tuple[int, ...]:
        """The capture ladder every graphed path uses (pp_breakable's default ladder up to the cap)."""
        from ppcompile.runtime.buckets import default_capture_ladder

        return default_capture_ladder(self.capture_cap)

    def _build(self, path: PathSpec) -> Callable[..., Any]:
        if path.kind == "eager":
            return self.stage
        if path.kind == "pp_breakable":
            options = {"max_capture_tokens": self.capture_cap, **path.backend_options(self.device)}
            # The symbolic token count comes from the token dims batch() marks (no dynamic=True: it
            # would pass every float module attribute as a per-call tensor input; user guide).
            return torch.compile(self.stage, backend="pp_breakable", options=options)
        if path.kind == "reduce-overhead":
            configure_torch_partition(self.buckets)
            # Marked token dims here too (not dynamic=True), so both graphed paths pay the same
            # Dynamo cost per call and the comparison is of the graphs.
            return torch.compile(self.stage, mode="reduce-overhead")
        raise ValueError(f"PathSpec.kind: unknown {path.kind!r}")

    def batch(self, seq_lens: Sequence[int], seed: int = 0) -> Batch:
        ids, pos, proxies = make_batch(self.cfg, seq_lens, self.spec.pp_rank, self.spec.pp_size,
                                       seed=seed, device=self.device)
        ppcompile.mark_token_dynamic(ids, pos, proxies)
        ctx = make_forward_context(seq_lens, self.cfg, self.layer_ids, device=self.device)
        return Batch(list(seq_lens), (ids, pos, proxies), ctx)

    def call(self, name: str, batch: Batch) -> Any:
        """Runs ``batch`` through path ``name`` (outputs valid until the path's next call)."""
        if self.paths[name].kind == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with set_forward_context(batch.ctx):
            return self.modules[name](*batch.args)

    def warm_up(self, name: str, batches: Sequence[Batch], passes: int | None = None) -> bool:
        """Compiles and captures ``name`` (timed), runs ``batches`` ``passes`` times (default: twice on
        CUDA, where torch's CUDA graph trees record a size on its second call; once on CPU), checks its
        output on the last batch against eager's (``max_diffs``). A path that fails is dropped from
        ``modules`` with the reason in ``failed``, so one broken path does not cost the others' figures.

        Inductor segments are compiled with ``cpp.enable_kernel_profile`` (CPU) so that their kernels
        show up in ``torch.profiler``.
        """
        path = self.paths[name]
        if passes is None:
            passes = 2 if self.device.type == "cuda" else 1
        inductor_segments = path.options.get("segment_compiler") == "inductor"
        kernel_profile = _inductor_kernel_profile() if inductor_segments else _null()
        before = capture_totals()
        start = time.perf_counter()
        try:
            with torch.inference_mode(), kernel_profile:
                self.call(name, batches[0])
                sync(self.device)
                self.compile_seconds[name] = time.perf_counter() - start
                if path.kind == "pp_breakable":
                    after = capture_totals()
                    self.captures[name] = {k: None if after[k] is None else after[k] - (before[k] or 0)
                                           for k in after}
                for _ in range(passes):
                    for b in batches:
                        self.call(name, b)
                sync(self.device)
                if name != "eager":
                    self.max_diffs[name] = self.max_diff(name, batches[-1])
        except Exception as e:  # report and go on: the other paths still get measured
            reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
            log.warning("benchmark path %s failed and is dropped: %s", name, reason)
            self.failed[name] = reason
            self.modules.pop(name, None)
            return False
        return True

    def max_diff(self, name: str, batch: Batch) -> float:
        """Largest absolute difference between ``name``'s outputs and eager's on ``batch``."""
        with torch.inference_mode():
            want = [t.float().clone() for t in _tensor_leaves(self.call("eager", batch))]
            got = [t.float() for t in _tensor_leaves(self.call(name, batch))]
        if len(want) != len(got):
            raise RuntimeError(f"path {name} returned {len(got)} tensors, eager {len(want)}")
        return max(((g - w).abs().max().item() for g, w in zip(got, want)), default=0.0)

    def time_forward(self, name: str, batch: Batch) -> float:
        """Seconds of one forward through ``name``, device work included (synchronised)."""
        with torch.inference_mode():
            start = time.perf_counter()
            self.call(name, batch)
            sync(self.device)
        return time.perf_counter() - start

    def time_stream(self, name: str, batches: Sequence[Batch]) -> float:
        """Seconds to run every batch of the stream through ``name`` (device synchronised at the end)."""
        with torch.inference_mode():
            sync(self.device)
            start = time.perf_counter()
            for b in batches:
                self.call(name, b)
            sync(self.device)
        return time.perf_counter() - start

    def graph_mode(self, name: str) -> str:
        """What serves ``name``'s graphed forwards: ``cuda``, ``emulate``, ``eager`` (static buffers, no
        graphs), ``none`` (live size) or -."""
        path = self.paths[name]
        if path.kind == "reduce-overhead":
            return "cuda"
        if path.kind != "pp_breakable":
            return "-"
        mode = str(path.backend_options(self.device).get("graph_mode", "auto"))
        if mode == "auto":
            return "cuda" if self.device.type == "cuda" else "none"
        return mode


def _tensor_leaves(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, Mapping):
        return [t for k in sorted(out) for t in _tensor_leaves(out[k])]
    if isinstance(out, (list, tuple)):
        return [t for x in out for t in _tensor_leaves(x)]
    return []


def configure_torch_partition(buckets: Sequence[int]) -> dict[str, Any]:
    """Sets Inductor up for ``mode="reduce-overhead"`` with a graph partition at the attention op and
    CUDA graphs only for ``buckets``; returns what was set (names missing from this torch are skipped)."""
    import torch._inductor.config as inductor_config

    wanted: dict[tuple[Any, str], Any] = {
        (inductor_config, "graph_partition"): True,
        (inductor_config, "custom_should_partition_ops"): [ATTENTION_OP],
        (inductor_config.triton, "cudagraph_capture_sizes"): tuple(buckets),
        (inductor_config.triton, "cudagraph_dynamic_shape_warn_limit"): None,
    }
    applied: dict[str, Any] = {}
    for (owner, name), value in wanted.items():
        if hasattr(owner, name):
            setattr(owner, name, value)
            applied[name] = value
        else:
            log.warning("torch %s has no inductor config %r; reduce-overhead runs without it",
                        torch.__version__, name)
    return applied


def _inductor_kernel_profile() -> Any:
    """Inductor's CPU kernels show up in ``torch.profiler`` only with ``cpp.enable_kernel_profile``."""
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config, "cpp") and hasattr(inductor_config.cpp, "enable_kernel_profile"):
        return inductor_config.patch({"cpp.enable_kernel_profile": True})
    return _null()


def _null() -> Any:
    import contextlib

    return contextlib.nullcontext()


# ------------------------------------------------------------------------------------------ streams
def prefill_stream(
    cap: int, num_forwards: int, rng: random.Random, isl: int, full_fraction: float = 0.5
) -> list[list[int]]:
    """Sequence lengths of ``num_forwards`` prefill forwards under an aggregate token ``cap``.

    A chunked-prefill scheduler in miniature: requests of ``isl/2 .. isl`` prompt tokens are served in
    order, each forward takes up to its budget of tokens (the last request of a forward is chunked and
    continues in the next). A forward's budget is the full ``cap`` with probability ``full_fraction``,
    otherwise uniform in ``[cap/2, cap)``, so forward sizes vary as they do when admission is limited.
    """
    if cap < 2 or isl < 2 or num_forwards < 1:
        raise ValueError(f"prefill_stream: need cap >= 2, isl >= 2, num_forwards >= 1; "
                         f"got {cap}, {isl}, {num_forwards}")
    pending = 0
    stream = []
    for _ in range(num_forwards):
        budget = cap if rng.random() < full_fraction else rng.randint(cap // 2, cap - 1)
        lens = []
        while budget > 0:
            if pending == 0:
                pending = rng.randint(isl // 2, isl)
            take = min(pending, budget)
            lens.append(take)
            pending -= take
            budget -= take
        stream.append(lens)
    return stream


# ------------------------------------------------------------------------------------------ timing
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


# ------------------------------------------------------------------------------------------ presets
@dataclasses.dataclass(frozen=True)
class Suite:
    """Sizes of one benchmark run. Caps are the seed's 2K..32K divided by ``scale``; the capture cap
    (pp_breakable's ``max_capture_tokens``) and the requests' prompt length are 8192 / ``scale``."""

    stage: StageSpec
    scale: int
    forwards: int  # forwards per stream (per cap)
    repeats: int  # timed runs of every (cap, path); medians are reported
    paths: str
    threads: int | None = None
    profile_forwards: int = 8
    overhead_iters: int = 200
    overhead_layers: int = 32

    @property
    def caps(self) -> tuple[int, ...]:
        return tuple(c // self.scale for c in SEED_CAPS)

    @property
    def capture_cap(self) -> int:
        return 8192 // self.scale

    @property
    def isl(self) -> int:
        return 8192 // self.scale


SUITES: dict[str, Suite] = {
    # Under a minute on a loaded 2-core box, Inductor's first compile included.
    "cpu-quick": Suite(StageSpec(device="cpu"), scale=16, forwards=6, repeats=7,
                       paths="eager,ppb,ppb-static,ppb-inductor", threads=1, profile_forwards=6,
                       overhead_iters=100, overhead_layers=12),
    "cpu": Suite(StageSpec(device="cpu"), scale=8, forwards=12, repeats=5,
                 paths="eager,ppb,ppb-static,ppb-inductor", threads=1, profile_forwards=12,
                 overhead_iters=500),
    # One H200: a small-model stage (8 of 32 layers, hidden 1024, bf16) at the seed's own caps.
    "cuda": Suite(StageSpec(layers=32, hidden=1024, dtype="bfloat16", device="cuda"), scale=1,
                  forwards=8, repeats=5, paths="eager,ppb,ppb-torch-copies,ppb-inductor,torch-ro",
                  profile_forwards=10,
                  overhead_iters=200),
    # Tiny sizes for the smoke test and the GPU script's dry run: every code path, seconds.
    "smoke": Suite(StageSpec(preset="tiny", layers=2, pp_size=2, pp_rank=1, device="cpu"), scale=256,
                   forwards=2, repeats=1, paths="eager,ppb,ppb-static", threads=1, profile_forwards=2,
                   overhead_iters=3, overhead_layers=2),
}


def add_suite_arguments(parser: Any) -> None:
    """Command-line options shared by the benchmark scripts and ``python -m ppcompile bench``."""
    parser.add_argument("--suite", choices=sorted(SUITES), default=None,
                        help="sizes preset (default: cuda when a GPU is present, else cpu-quick)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--paths", default=None,
                        help=f"comma-separated paths (valid: {','.join(PATHS)}; eager is always in)")
    parser.add_argument("--preset", default=None, help="reference model preset of the stage")
    parser.add_argument("--layers", type=int, default=None, help="total model layers (stage gets 1/PP)")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (heads and MLP rescale)")
    parser.add_argument("--experts", type=int, default=None, help="MoE experts (0: dense MLP)")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16")
    parser.add_argument("--pp", type=int, default=None, help="pipeline-parallel stages")
    parser.add_argument("--rank", type=int, default=None, help="which stage to benchmark")
    parser.add_argument("--scale", type=int, default=None, help="divide the seed's caps by this")
    parser.add_argument("--forwards", type=int, default=None, help="forwards per stream")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per (cap, path)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads on CPU")
    parser.add_argument("--seed", type=int, default=0, help="seed of the streams and inputs")


def suite_from_args(args: Any) -> Suite:
    """The chosen suite preset with the command line's overrides applied."""
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device on this machine; use --device cpu")
    name = args.suite or ("cuda" if device == "cuda" else "cpu-quick")
    suite = SUITES[name]
    stage = dataclasses.replace(suite.stage, device=device)
    overrides = {"preset": args.preset, "layers": args.layers, "hidden": args.hidden,
                 "experts": args.experts, "dtype": args.dtype, "pp_size": args.pp, "pp_rank": args.rank}
    stage = dataclasses.replace(stage, **{k: v for k, v in overrides.items() if v is not None})
    changes: dict[str, Any] = {"stage": stage}
    for key in ("scale", "forwards", "repeats", "paths", "threads"):
        if getattr(args, key, None) is not None:
            changes[key] = getattr(args, key)
    return dataclasses.replace(suite, **changes)


def apply_threads(suite: Suite) -> None:
    if suite.threads is not None and suite.stage.device == "cpu":
        torch.set_num_threads(suite.threads)


def make_harness(suite: Suite) -> StageHarness:
    device = torch.device(suite.stage.device)
    return StageHarness(suite.stage, parse_paths(suite.paths, device), suite.capture_cap)

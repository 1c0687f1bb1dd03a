"""``PPBreakableConfig``: the validated form of ``torch.compile(..., options={...})``.

Every key is a field below. Unknown keys and bad values raise ``ValueError`` naming the key, the value
and the valid choices, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ppcompile import envs
from ppcompile.engine_ops import refuse_token_local

__all__ = ["DEFAULT_MAX_CAPTURE_TOKENS", "DEFAULT_WHOLE_GRAPH_TOKENS", "GRAPH_MODES", "SEGMENT_COMPILERS",
           "PPBreakableConfig", "default_capture_ladder", "graph_path_mode", "is_process_group",
           "live_mode_reason", "resolve_graph_mode"]

DEFAULT_MAX_CAPTURE_TOKENS = 8192
"""Last size where the seed engine change measured graphs ahead of eager on a PP stage."""

DEFAULT_WHOLE_GRAPH_TOKENS = 256
"""Whole-stage graphs up to this many tokens, where breaks' host gaps dominate a forward: the region
SGLang's full prefill graphs and sfllm measured ahead; not yet measured on ppcompile (docs/benchmarks.md)."""

DEFAULT_FOLD_GRAPH_OPS = 2
"""Graph segments between two breaks with at most this many ops that launch kernels are folded into one
eager break (measured crossover: docs/benchmarks.md, "Folding tiny graph segments")."""

SEGMENT_COMPILERS = ("eager", "inductor")
CAPTURE_POLICIES = ("all", "lazy")
COPY_KERNELS = ("auto", "triton", "torch")
GRAPH_MODES = ("auto", "cuda", "emulate", "eager", "none")
ON_UNSAFE = ("break", "error")


def graph_path_mode(device_type: str) -> str:
    """The ``graph_mode`` that takes the graph path on a ``device_type`` device: CUDA graphs on CUDA, their
    emulation elsewhere. For what shows or measures the graph path (the demo, ``dump``, the gain probe,
    the benchmarks); serving keeps ``"auto"``, which runs CPU stages at the live size instead."""
    return "cuda" if device_type == "cuda" else "emulate"


def resolve_graph_mode(graph_mode: str, on_cuda: bool, cuda_available: bool | None = None) -> str:
    """The graph mode a stage serves with, for ``graph_mode`` (an option) and whether its tensors are on
    a CUDA device: ``"auto"`` picks the fastest correct one, CUDA graphs for CUDA tensors (with a CUDA
    runtime: ``cuda_available``, None asks ``torch.cuda.is_available()``) and otherwise the live-size
    path ``"none"`` (on CPU there are no launches to save, and the emulation of graphs only adds copy-in,
    padding and copies: docs/benchmarks.md); ``"cuda"`` off CUDA is refused."""
    if graph_mode == "auto":
        if cuda_available is None:
            cuda_available = torch.cuda.is_available()
        return "cuda" if on_cuda and cuda_available else "none"
    if graph_mode == "cuda" and not on_cuda:
        raise ValueError(
            "pp_breakable option 'graph_mode': got 'cuda' but the stage's tensors are not on a CUDA "
            "device; on CPU use 'auto' (live-size segments, the fastest there) or 'emulate' (graph semantics)"
        )
    return graph_mode


def live_mode_reason(graph_mode: str) -> str:
    """Why a stage whose option is ``graph_mode`` serves at the live size (it resolved to ``"none"``)."""
    asked = ("graph_mode='none'" if graph_mode == "none" else
             "graph_mode='auto' off CUDA resolves to graph_mode='none' (faster on CPU than emulated "
             "graphs; 'emulate' runs the graph path)")
    return f"{asked}: the segments run at the live token count, with no graphs, padding or static buffers"


_DENSE_LIMIT = 32
_STEPS_PER_OCTAVE = 8


def default_capture_ladder(max_tokens: int) -> tuple[int, ...]:
    """The default bucket sizes up to and including ``max_tokens``."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sizes = [1, 2, *range(4, _DENSE_LIMIT + 1, 4)]
    octave = _DENSE_LIMIT
    while octave < max_tokens:
        step = octave // _STEPS_PER_OCTAVE
        sizes.extend(range(octave + step, 2 * octave + 1, step))
        octave *= 2
    ladder = [s for s in sizes if s <= max_tokens]
    if ladder[-1] != max_tokens:
        ladder.append(max_tokens)
    return tuple(ladder)


@dataclasses.dataclass(frozen=True)
class PPBreakableConfig:
    """Options of the ``pp_breakable`` backend.

    Attributes:
        capture_sizes: explicit token buckets to capture; overrides the default ladder and
            ``max_capture_tokens`` (the largest size becomes the cap).
        max_capture_tokens: cap of the default ladder; forwards above it run eagerly.
        split_ops: extra ops to break at, as ``"namespace::op"`` strings or op objects. Attention of the
            reference models and ``scaled_dot_product_attention`` are always breaks.
        segment_compiler: ``"eager"`` runs each graph segment's FX code as is; ``"inductor"`` compiles it
            once for the symbolic token count (identical segments share one compile).
        compile_sizes: with ``segment_compiler="inductor"``, buckets that also get a static-shape
            compile of every graph segment, used at exactly those token counts. Each must be a bucket.
        dedup_segments: share one compile among segments of the same structure (the same layer
            repeated), across the stages of the process too. Off only to debug the sharing.
        inductor_config: with ``segment_compiler="inductor"``, ``torch._inductor.config`` settings
            applied to every segment compile (``config_patches``), e.g. ``{"cpp_wrapper": True}``.
        graph_mode: ``"cuda"`` (CUDA graphs), ``"emulate"`` (CPU emulation of graph semantics),
            ``"eager"`` (same static-buffer path, no graphs), ``"none"`` (no graphs, buckets or static
            buffers: the compiled segments run at the live token count) or ``"auto"`` (the fastest
            correct mode: cuda on CUDA tensors, else none; the emulation is a test aid, slower on CPU).
        max_padding_factor: a forward whose bucket exceeds this times its token count runs eagerly.
        on_unsafe: what to do with a graphed op that mixes token rows (so padding could leak):
            ``"break"`` runs it eagerly on live rows, ``"error"`` fails the compile naming it.
        token_local_ops: ops to treat as token-local (row i of the outputs depends only on row i of
            the inputs) in addition to the known ones, as ``"namespace::op"`` strings or op objects.
        capture: ``"all"`` captures every bucket at the first graph-path call (largest first);
            ``"lazy"`` captures a bucket at the first call that needs it (one failed bucket then runs
            eagerly while the others keep their graphs).
        capture_budget_s: with ``capture="lazy"``, the first call also captures further buckets, in
            order of the tokens the process served with each (``ppcompile.token_histogram()``), then
            largest first, until this many seconds are spent; the rest stay lazy.
        fold_graph_ops: a graph segment between two breaks with at most this many kernel-launching ops
            (views and size arithmetic are free) runs eagerly, joining the breaks around it into one;
            0 keeps every graph segment that launches a kernel.
        copy_kernel: how the graph path copies live inputs into static buffers and break outputs into
            bridges: ``"triton"`` (one fused launch per copy point: all inputs, or all copied outputs of
            one break; needs Triton: CUDA, or its CPU interpreter), ``"torch"`` (a ``copy_`` and a
            ``zero_`` per tensor) or ``"auto"`` (triton on CUDA when importable, else torch).
        dump_dir: write pass dumps here (default: ``PPCOMPILE_DUMP_DIR``).
        debug: check at every replay that graphs read the captured tensors, and detect reads of
            outputs that a later call overwrote.
        owned_outputs: whether a graph-path call returns copies of its outputs that live in static memory
            (the caller owns them: they never change, whatever it keeps or sends) or views into that
            memory, valid until a later call overwrites it (no copy; for engines that manage lifetimes).
            Default (None): copies, unless ``output_slots`` > 1 asks for views into a ring.
        output_slots: for how many forwards a graph-path call's views stay valid (with
            ``owned_outputs=False`` or a ring): those of forward i until forward i + ``output_slots``
            starts. 1: until the next call (views into graph memory, no copy); k > 1: each forward
            copies its outputs that live in static memory into slot ``i mod k`` of a ring and returns
            views of it (one copy per such output per forward; memory: k times those outputs at the
            largest bucket), so a PP loop can send forward i's outputs while forward i + 1 runs.
        collective_ops: engine-style collective custom ops the stage calls (an all-reduce registered
            with ``torch.library.custom_op``, out-of-place or in-place), as ``"namespace::op"`` strings or
            op objects: row i of each output combines row i of the input across the ranks of the group,
            so they stay in graph segments like Dynamo's functional collectives, and the stage's
            decisions are agreed across ``tp_group``. Their Python implementations are never run at
            compile time.
        tp_group: the process group whose ranks run this stage's collectives together (its TP group).
            Its ranks take the same path and bucket on every forward: decisions that could differ (a
            capture that fails, a capture budget) are agreed with a few collectives at capture time,
            none per forward. Default: the group the stage's traced collectives name; a stage that calls
            ``collective_ops`` in a world of more than one rank must be given it.
        whole_graph_tokens: a stage whose every break is an op declared capturable
            (``ppcompile.declare_capturable``) serves forwards of up to this many tokens with one graph
            per bucket, its breaks inside (``runtime/whole_stage.py``); larger ones take the breakable
            path. 0: never. Stages with an undeclared break are breakable at every size.
    """

    capture_sizes: tuple[int, ...] | None = None
    max_capture_tokens: int = DEFAULT_MAX_CAPTURE_TOKENS
    split_ops: tuple[Any, ...] = ()
    segment_compiler: str = "eager"
    compile_sizes: tuple[int, ...] = ()
    dedup_segments: bool = True
    inductor_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    graph_mode: str = "auto"
    max_padding_factor: float = 2.0
    on_unsafe: str = "break"
    token_local_ops: tuple[Any, ...] = ()
    capture: str = "all"
    capture_budget_s: float | None = None
    fold_graph_ops: int = DEFAULT_FOLD_GRAPH_OPS
    copy_kernel: str = "auto"
    dump_dir: str | None = None
    debug: bool = False
    owned_outputs: bool | None = None
    output_slots: int = 1
    collective_ops: tuple[Any, ...] = ()
    tp_group: Any = None
    whole_graph_tokens: int = DEFAULT_WHOLE_GRAPH_TOKENS

    def __post_init__(self) -> None:
        if self.capture_sizes is not None:
            sizes = self.capture_sizes
            if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
                _bad("capture_sizes", sizes, "a non-empty list of positive ints")
            if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
                _bad("capture_sizes", sizes, "a non-empty list of positive ints")
            object.__setattr__(self, "capture_sizes", tuple(sorted(set(sizes))))
        mct = self.max_capture_tokens
        if isinstance(mct, bool) or not isinstance(mct, int) or mct < 1:
            _bad("max_capture_tokens", mct, "a positive int")
        wgt = self.whole_graph_tokens
        if isinstance(wgt, bool) or not isinstance(wgt, int) or wgt < 0:
            _bad("whole_graph_tokens", wgt, "an int >= 0 (0: no whole-stage graphs)")
        for key in _OP_LISTS:
            object.__setattr__(self, key, _checked_ops(key, getattr(self, key)))
        if self.tp_group is not None and not is_process_group(self.tp_group):
            _bad("tp_group", self.tp_group, "a torch.distributed.ProcessGroup (the stage's TP group) or None")
        if self.segment_compiler not in SEGMENT_COMPILERS:
            _bad("segment_compiler", self.segment_compiler, " | ".join(map(repr, SEGMENT_COMPILERS)))
        self._check_compile_sizes()
        self._check_inductor_config()
        if self.graph_mode not in GRAPH_MODES:
            _bad("graph_mode", self.graph_mode, " | ".join(map(repr, GRAPH_MODES)))
        if self.on_unsafe not in ON_UNSAFE:
            _bad("on_unsafe", self.on_unsafe, " | ".join(map(repr, ON_UNSAFE)))
        mpf = self.max_padding_factor
        if isinstance(mpf, bool) or not isinstance(mpf, (int, float)) or not mpf >= 1.0:
            _bad("max_padding_factor", mpf, "a number >= 1.0")
        if self.capture not in CAPTURE_POLICIES:
            _bad("capture", self.capture, " | ".join(map(repr, CAPTURE_POLICIES)))
        budget = self.capture_budget_s
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
                _bad("capture_budget_s", budget, "a number of seconds > 0, or None")
            if self.capture != "lazy":
                _bad("capture_budget_s", budget, "None unless capture is 'lazy' (with 'all' every bucket is "
                     "captured at the first call)")
        if self.copy_kernel not in COPY_KERNELS:
            _bad("copy_kernel", self.copy_kernel, " | ".join(map(repr, COPY_KERNELS)))
        fold = self.fold_graph_ops
        if isinstance(fold, bool) or not isinstance(fold, int) or fold < 0:
            _bad("fold_graph_ops", fold, "an int >= 0 (0: fold nothing)")
        if self.dump_dir is not None and not isinstance(self.dump_dir, str):
            _bad("dump_dir", self.dump_dir, "a path string or None")
        for flag in ("debug", "dedup_segments"):
            if not isinstance(getattr(self, flag), bool):
                _bad(flag, getattr(self, flag), "True or False")
        slots = self.output_slots
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            _bad("output_slots", slots, "an int >= 1 (1: outputs valid until the next call)")
        owned = self.owned_outputs
        if owned is not None and not isinstance(owned, bool):
            _bad("owned_outputs", owned, "True (copies), False (views into static memory) or None (copies "
                 "unless output_slots > 1)")
        if slots > 1 and owned:
            _bad("output_slots", slots, "1 with owned_outputs=True (owned outputs never expire; a ring "
                 "of output slots only bounds how long views stay valid)")
        # Resolved once, so that everything downstream (and compute_hash) sees a bool.
        object.__setattr__(self, "owned_outputs", slots == 1 if owned is None else owned)

    def _check_compile_sizes(self) -> None:
        sizes = self.compile_sizes
        if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or any(
            isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes
        ):
            _bad("compile_sizes", sizes, "a list of positive ints (buckets to specialise)")
        sizes = tuple(sorted(set(sizes)))
        object.__setattr__(self, "compile_sizes", sizes)
        if not sizes:
            return
        if self.segment_compiler != "inductor":
            _bad("compile_sizes", sizes, "[] unless segment_compiler is 'inductor' (eager segments "
                 "have nothing to specialise)")
        buckets = self.capture_sizes or default_capture_ladder(self.max_capture_tokens)
        missing = [s for s in sizes if s not in buckets]
        if missing:
            _bad("compile_sizes", sizes, f"bucket sizes only; {missing} are not buckets (capture sizes: "
                 f"{list(buckets) if len(buckets) <= 16 else [*buckets[:8], '...', *buckets[-4:]]})")

    def _check_inductor_config(self) -> None:
        patches = self.inductor_config
        if not isinstance(patches, Mapping) or any(not isinstance(k, str) for k in patches):
            _bad("inductor_config", patches, "a dict of torch._inductor.config settings, e.g. "
                 "{'cpp_wrapper': True}")
        if patches and self.segment_compiler != "inductor":
            _bad("inductor_config", dict(patches), "{} unless segment_compiler is 'inductor'")
        if patches:
            from ppcompile.torch_internals import inductor_config_copy

            known = inductor_config_copy()
            unknown = sorted(k for k in patches if k not in known)
            if unknown:
                _bad("inductor_config", dict(patches), f"torch._inductor.config settings; {unknown} are "
                     "not settings of this torch")
        object.__setattr__(self, "inductor_config", dict(patches))

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> PPBreakableConfig:
        """Builds the config from ``torch.compile``'s ``options`` dict over ``PPCOMPILE_OPTIONS`` (the
        dict wins where both name a key); rejects unknown keys."""
        from_env, given = envs.options(), options
        options = {**from_env, **dict(given or {})}
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            where = " (from PPCOMPILE_OPTIONS)" if set(unknown) <= set(from_env) else ""
            raise ValueError(
                f"pp_breakable: unknown option(s) {unknown}{where}; valid options are {valid}"
            )
        if "dump_dir" not in options:
            options["dump_dir"] = envs.dump_dir()
        for key in ("capture_sizes", "compile_sizes"):
            if isinstance(options.get(key), (list, tuple)):
                options[key] = tuple(options[key])
        try:
            return cls(**options)
        except ValueError as e:
            inherited = sorted(k for k in from_env if k not in (given or {}))
            if inherited:  # in the message: Dynamo's wrapper of a backend's error drops notes
                raise ValueError(f"{e} (options {inherited} came from PPCOMPILE_OPTIONS)") from None
            raise

    @property
    def cap(self) -> int:
        """Largest token count served by a graph."""
        return max(self.capture_sizes) if self.capture_sizes else self.max_capture_tokens

    def as_dict(self) -> dict[str, Any]:
        """Every option as plain data (ops by name, the TP group by its ranks), for hashes and reports."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key in _OP_LISTS:
            fields[key] = [_op_key(op) for op in fields[key]]
        for key in ("capture_sizes", "compile_sizes"):
            if fields[key] is not None:
                fields[key] = list(fields[key])
        fields["inductor_config"] = dict(self.inductor_config)
        fields["tp_group"] = None if self.tp_group is None else _group_ranks(self.tp_group)
        return fields

    def compute_hash(self) -> str:
        """A stable hash of every field that changes what is compiled or captured."""
        fields = self.as_dict()
        fields.pop("dump_dir")
        return hashlib.sha256(json.dumps(fields, sort_keys=True, default=repr).encode()).hexdigest()[:16]


_OP_LISTS = ("split_ops", "token_local_ops", "collective_ops")


def is_process_group(group: Any) -> bool:
    """Whether ``group`` is a ``torch.distributed.ProcessGroup`` (False where torch has no distributed)."""
    import torch.distributed as dist

    return dist.is_available() and isinstance(group, dist.ProcessGroup)


def _group_ranks(group: Any) -> list[int]:
    """A process group's global ranks (the same in every process of the job)."""
    import torch.distributed as dist

    return list(dist.get_process_group_ranks(group)) if dist.is_initialized() else []


def _checked_ops(key: str, ops: Any) -> tuple[Any, ...]:
    if isinstance(ops, (str, bytes)) or not isinstance(ops, Sequence):
        _bad(key, ops, 'a list of "namespace::op" strings or op objects')
    for op in ops:
        if isinstance(op, str) and (op.count("::") != 1 or not all(op.split("::"))):
            _bad(key, op, 'strings of the form "namespace::op"')
        if key == "token_local_ops":
            refuse_token_local(op)
    return tuple(ops)


def _op_key(op: Any) -> str:
    """A split op's name that is the same in every process (``str`` of a function holds its address)."""
    if isinstance(op, str):
        return op
    module, name = getattr(op, "__module__", None), getattr(op, "__name__", None)
    return f"{module}.{name}" if module and name else str(op)


def _bad(key: str, value: Any, valid: str) -> None:
    raise ValueError(f"pp_breakable option {key!r}: got {value!r}; expected {valid}")

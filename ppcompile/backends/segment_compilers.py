"""Segment compilers: turn the graph segments of a split stage into callables.

* ``eager``: the segment's own FX code, run as is.
* ``inductor``: ``compile_fx`` over the segment's symbolic example inputs, so one compile serves every
  bucket (and the live sizes of the eager path). ``compile_sizes`` adds artifacts specialised to
  chosen buckets (static shapes), used at exactly those token counts.

Compile once per structure: each graph segment gets a *structural key* (``structural_key.py``: its
code, input metadata and roles, and the compiler options, names aside); segments with equal keys share
one compiled artifact, each call site passing its own parameters, so a stage of 32 identical layers (65
segments) compiles about three. The cache is process-wide, so the stages of one process share too.
``counters.segment_compiles`` counts artifacts compiled, ``counters.segment_cache_hits`` the segments
that reused one.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import sympy
import torch

from ppcompile.analysis.node_facts import SEGMENT
from ppcompile.counters import counters
from ppcompile.observe.progress import Progress
from ppcompile.passes.context import PassContext
from ppcompile.records import InputKind, SegmentCompile
from ppcompile.symbolic import example_value, size_expr
from ppcompile.torch_internals import (
    current_shape_env,
    dynamo_compile_start_ns,
    inductor_compile,
    inductor_config_copy,
    is_float_symbol,
    restart_analysis,
    shape_env_hints,
    static_fake_mode,
    tracing_context,
    without_dynamo_disable,
)
from ppcompile.torch_internals import shape_env_facts as _shape_facts  # a name tests patch

from .eager_code import EagerCode
from .stored_kernels import storable_compile
from .structural_key import clear_pinned, structural_key

__all__ = [
    "SEGMENT_INDUCTOR_DEFAULTS",
    "SegmentCompile",
    "SizeDispatch",
    "clear_segment_cache",
    "compile_segments",
    "compile_times",
    "dynamo_trace_seconds",
    "segment_inductor_config",
    "segments_skip_size_asserts",
    "structural_key",
]

log = logging.getLogger(__name__)

SegmentFn = Callable[..., Any]

_ARTIFACTS: dict[str, tuple[SegmentFn, weakref.ref[Any] | None]] = {}
"""Process-wide: structural key -> (compiled artifact, the shape env it is confined to, or None)."""


SEGMENT_INDUCTOR_DEFAULTS: Mapping[str, Any] = {"size_asserts": False}
"""Inductor settings of every segment compile unless ``inductor_config`` sets them. ``size_asserts``:
Inductor checks the size and stride of every input per call (about 0.5 us each, ~10 per decoder
segment). A segment's inputs are Dynamo-guarded stage inputs and parameters, outputs of other compiled
segments (laid out as traced), static buffers (in the traced layout, checked per bucket at capture)
or break outputs, which the runtime checks itself (``runtime/layout_checks.py``), once per output rather
than once per reading segment."""


def segment_inductor_config(config: Any) -> dict[str, Any]:
    """The Inductor settings segments are compiled with: the defaults, then ``config.inductor_config``."""
    return {**SEGMENT_INDUCTOR_DEFAULTS, **config.inductor_config}


def segments_skip_size_asserts(config: Any) -> bool:
    """Whether Inductor segments are compiled without input size asserts (the runtime then checks the
    break outputs they read)."""
    return config.segment_compiler == "inductor" and not segment_inductor_config(config)["size_asserts"]


def clear_segment_cache() -> None:
    """Forgets every shared artifact (the next compile of each structure compiles again)."""
    _ARTIFACTS.clear()
    clear_pinned()


# ----------------------------------------------------------------------------------- compiling
def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A fresh graph module over the same attributes: Inductor's pre-grad passes rewrite in place."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return torch.fx.GraphModule(gm, graph)


@contextlib.contextmanager
def _float_symbols_hidden() -> Iterator[None]:
    """Hides the float symbols of Dynamo's shape environment from one segment's compile.

    Inductor's ``tensorify_python_scalars`` asks Dynamo to re-trace the whole stage (floats baked in)
    whenever the shape environment holds a float symbol the graph it compiles did not consume. A
    segment never sees the floats of the others (break segments read per-call floats eagerly; the pass
    ``tensorify_float_attributes`` turned module floats into tensors), so without this every stage with a
    float input would be traced twice, and per-call floats would be specialised (a recompile per value).
    """
    shape_env = current_shape_env()
    if shape_env is None:  # no Dynamo trace around this compile: no shape env to hide floats of
        yield
        return
    values = shape_env_hints(shape_env)
    hidden = {k: v for k, v in values.items() if is_float_symbol(k)}
    for k in hidden:
        del values[k]
    try:
        yield
    finally:
        values.update(hidden)


def _without_dynamo_disable(fn: SegmentFn) -> SegmentFn:
    """``fn`` without the Dynamo ``disable`` wrappers ``compile_fx`` puts around its artifact.

    Each wrapper switches Dynamo's frame callback off and back on per call (about 1.5 us). A segment
    only ever runs inside its ``StageRuntime``, which Dynamo calls through a disable wrapper of its own
    ("do not trace Dynamo-compiled graph"), so the inner ones change nothing but the cost.
    """
    return without_dynamo_disable(fn)


def _compile_symbolic(gm: torch.fx.GraphModule, patches: Mapping[str, Any] | None = None) -> SegmentFn:
    """Inductor over the traced (fake, symbolic) inputs, inside Dynamo's tracing context."""
    inputs = [example_value(p) for p in gm.graph.find_nodes(op="placeholder")]
    with _float_symbols_hidden():
        compiled = inductor_compile(_copy(gm), inputs, patches)
    return _without_dynamo_disable(compiled)


def _concrete(v: Any, env: Mapping[sympy.Symbol, int]) -> Any:
    def num(s: Any) -> int:
        e = size_expr(s).xreplace(env)
        if e.free_symbols:
            raise _NotSpecialisable(f"size {e} depends on a symbol other than the token count")
        return int(e)

    if isinstance(v, torch.Tensor):  # called under the compile's own fake mode: no memory
        return torch.empty_strided([num(s) for s in v.shape], [num(s) for s in v.stride()],
                                   dtype=v.dtype, device=v.device)
    if isinstance(v, torch.SymInt):
        return num(v)
    if isinstance(v, (torch.SymFloat, torch.SymBool)):
        raise _NotSpecialisable(f"a symbolic {type(v).__name__} input")
    return v


class _NotSpecialisable(Exception):
    pass


def _compile_static(
    gm: torch.fx.GraphModule, token_symbol: sympy.Symbol, size: int, patches: Mapping[str, Any] | None = None
) -> SegmentFn:
    """Inductor with every token dim fixed to ``size``, in a tracing context of its own (no symbols)."""
    env = {token_symbol: sympy.Integer(size)}
    fake_mode = static_fake_mode()
    with fake_mode:
        inputs = [_concrete(example_value(p), env) for p in gm.graph.find_nodes(op="placeholder")]
    fresh = _copy(gm)
    for node in fresh.graph.nodes:  # symbolic meta of Dynamo's shape env must not leak into this one
        node.meta.pop("example_value", None)
        node.meta.pop("val", None)
    with tracing_context(fake_mode):
        compiled = inductor_compile(fresh, inputs, patches)
    return _without_dynamo_disable(compiled)


def _token_locator(gm: torch.fx.GraphModule, token_symbol: sympy.Symbol) -> tuple[int, int] | None:
    """(input, dim) whose size is exactly the token count; dim -1 for a SymInt input."""
    for i, p in enumerate(gm.graph.find_nodes(op="placeholder")):
        v = example_value(p)
        if isinstance(v, torch.SymInt) and size_expr(v) == token_symbol:
            return i, -1
        if isinstance(v, torch.Tensor):
            for d, s in enumerate(v.shape):
                if size_expr(s) == token_symbol:
                    return i, d
    return None


class SizeDispatch:
    """Calls a static-shape artifact at its token count and the symbolic one otherwise."""

    __slots__ = ("by_size", "dim", "general", "slot")

    def __init__(self, general: SegmentFn, by_size: dict[int, SegmentFn], slot: int, dim: int) -> None:
        self.general = general
        self.by_size = by_size
        self.slot = slot
        self.dim = dim

    def __call__(self, *args: Any) -> Any:
        a = args[self.slot]
        n = int(a) if self.dim < 0 else a.shape[self.dim]
        return self.by_size.get(n, self.general)(*args)


def _input_kinds(
    node: torch.fx.Node, placeholders: Mapping[torch.fx.Node, int], ctx: PassContext
) -> list[str]:
    kinds = []
    for a in node.args:
        if isinstance(a, torch.fx.Node) and a in placeholders and placeholders[a] < len(ctx.input_kinds):
            kind = ctx.input_kinds[placeholders[a]]
            kinds.append(kind.value if isinstance(kind, InputKind) else str(kind))
        else:
            kinds.append("intermediate")
    return kinds


def _compile_shared(
    sub: torch.fx.GraphModule, key: str, sizes: tuple[int, ...], ctx: PassContext
) -> tuple[SegmentFn, float, bool, tuple[int, ...]]:
    """The artifact for ``key``: from the process cache, or compiled now. Returns (fn, s, reused, sizes)."""
    shape_env = current_shape_env()
    hit = _ARTIFACTS.get(key) if ctx.config.dedup_segments else None
    if hit is not None and (hit[1] is None or hit[1]() is shape_env):
        counters.segment_cache_hits += 1
        fn = hit[0]
        return fn, 0.0, True, tuple(fn.by_size) if isinstance(fn, SizeDispatch) else ()
    start = time.perf_counter()
    before = _shape_facts(shape_env)
    patches = segment_inductor_config(ctx.config)
    fn = storable_compile(sub, lambda: _compile_symbolic(sub, patches))  # warm_compile stores it
    # A guard Inductor added is installed for this Dynamo graph only: confine the artifact to it.
    confined = weakref.ref(shape_env) if _shape_facts(shape_env) != before else None
    if confined is not None:
        log.info("%s: Inductor added shape guards compiling segment %s; it is shared within this stage "
                 "graph only", ctx.graph_name, key)
    done: dict[int, SegmentFn] = {}
    locator = _token_locator(sub, ctx.token_symbol) if sizes and ctx.token_symbol is not None else None
    if sizes and locator is None:
        log.debug("%s: segment %s has no input sized by the token count; compile_sizes skipped",
                  ctx.graph_name, key)
    elif locator is not None and ctx.token_symbol is not None:
        for b in sizes:
            try:
                done[b] = _compile_static(sub, ctx.token_symbol, b, patches)
            except _NotSpecialisable as e:
                log.debug("%s: segment %s not specialised to %d tokens: %s", ctx.graph_name, key, b, e)
                break
    if done and locator is not None:
        fn = SizeDispatch(fn, done, *locator)
    seconds = time.perf_counter() - start
    counters.segment_compiles += 1
    if ctx.config.dedup_segments:
        _ARTIFACTS[key] = (fn, confined)
    return fn, seconds, False, tuple(done)


def _inductor_config_hash() -> str:
    """Inductor's settings now: an artifact compiled under other settings is not shared."""
    items = sorted(inductor_config_copy().items(), key=lambda kv: kv[0])
    return hashlib.sha256(repr(items).encode()).hexdigest()[:16]


def compile_segments(
    split: torch.fx.GraphModule, ctx: PassContext
) -> tuple[dict[str, SegmentFn], list[SegmentCompile]]:
    """Callables for every segment of ``split`` (break segments run as is) and a record per graph
    segment: its structural key, whether it was compiled or reused, and the time spent."""
    config = ctx.config
    placeholders = {p: i for i, p in enumerate(split.graph.find_nodes(op="placeholder"))}
    inductor_settings = _inductor_config_hash() if config.segment_compiler == "inductor" else ""
    callables: dict[str, SegmentFn] = {}
    records: list[SegmentCompile] = []
    calls = list(split.graph.find_nodes(op="call_module"))
    eager_code = EagerCode()  # segments of alike layers share their generated code
    compiled_here = config.segment_compiler != "eager" and not ctx.is_static
    to_compile = sum(SEGMENT.of(n).is_graph for n in calls) if compiled_here else 0
    progress = Progress(f"pp_breakable segment compile {ctx.graph_name}", to_compile, "segments")
    for node in calls:
        name = str(node.target)
        sub = getattr(split, name)
        graphed = SEGMENT.of(node).is_graph and not ctx.is_static
        compiler = config.segment_compiler if graphed else "eager"
        if compiler == "eager":
            callables[name] = eager_code.forward(sub)
            continue
        sizes = tuple(config.compile_sizes)
        options = {"compiler": compiler, "compile_sizes": sizes, "inductor_settings": inductor_settings,
                   "inductor_config": sorted(segment_inductor_config(config).items())}
        key = structural_key(sub, _input_kinds(node, placeholders, ctx), options)
        try:
            fn, seconds, reused, done = _compile_shared(sub, key, sizes, ctx)
        except restart_analysis():
            raise  # Dynamo's own protocol: it re-traces and calls the backend again
        except Exception as e:
            progress.abort()
            raise RuntimeError(
                f"pp_breakable: {compiler} failed to compile graph segment {name} of {ctx.graph_name} "
                f"(key {key}): {type(e).__name__}: {e}. Set options={{'segment_compiler': 'eager'}} to run "
                "the segments uncompiled, or dump_dir to get the segment's code"
            ) from e
        callables[name] = fn
        records.append(SegmentCompile(name, key, compiler, seconds, reused, done))
        progress.advance(note="reused" if reused else f"compiled in {seconds:.1f} s")
        log.debug("%s: segment %s key %s %s in %.2f s", ctx.graph_name, name, key,
                  "reused" if reused else "compiled", seconds)
    if to_compile:
        fresh = sum(not r.reused for r in records)
        progress.finish(f"{fresh} compiled, {len(records) - fresh} reused in {progress.elapsed_s:.2f} s")
    return callables, records


# ----------------------------------------------------------------------------------- accounting
def dynamo_trace_seconds() -> float | None:
    """Seconds since Dynamo started compiling this frame (its trace), or None outside a compile."""
    start_ns = dynamo_compile_start_ns()
    return (time.time_ns() - start_ns) / 1e9 if start_ns is not None else None


def compile_times(
    dynamo_seconds: float | None, ctx: PassContext, records: Sequence[SegmentCompile]
) -> dict[str, float]:
    """Seconds by phase, also logged: ``dynamo_trace`` (when obtainable), ``passes`` and
    ``pass.<name>``, and ``segment_compile`` (the segments compiled here; reused ones cost nothing).
    Per-segment detail is in ``records``."""
    times = {"passes": sum(ctx.pass_times.values())}
    if dynamo_seconds is not None:
        times["dynamo_trace"] = dynamo_seconds
    times.update({f"pass.{k}": v for k, v in ctx.pass_times.items()})
    times["segment_compile"] = sum(r.seconds for r in records)
    compiled = [r for r in records if not r.reused]
    log.info("%s: compile times: dynamo trace %s, passes %.2f s, segment compile %.2f s "
             "(%d graph segments: %d compiled, %d reused)", ctx.graph_name,
             "n/a" if dynamo_seconds is None else f"{dynamo_seconds:.2f} s", times["passes"],
             times["segment_compile"], len(records), len(compiled), len(records) - len(compiled))
    for r in compiled:
        log.info("%s:   compiled %s (%s, key %s%s) in %.2f s", ctx.graph_name, r.segment, r.compiler,
                 r.key, f", sizes {list(r.sizes)}" if r.sizes else "", r.seconds)
    return times

"""Every private torch API ppcompile uses, behind one named entry each (this package;
``lookup`` holds the lookups every entry goes through, ``precompile`` the entries of warm restarts).

Nothing else in ``ppcompile`` touches ``torch._*``, ``torch.utils._*`` or ``torch.fx.experimental``
(``tests/test_torch_internals.py`` checks it, and calls every entry on the installed torch). An entry whose
API is gone raises :class:`TorchInternalsError` naming the torch version and the missing module or
attribute; none falls back silently. Entries used at import or per call are bound when this module is
imported; the others look their API up at each call (a dict lookup beside what they call), so a patched
attribute is seen. Supported: torch >= 2.11; every entry below exists unchanged from 2.11 to 2.13, so
none needs a per-version branch.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

import sympy
import torch

from ppcompile.errors import add_note
from ppcompile.torch_internals.lookup import TorchInternalsError
from ppcompile.torch_internals.lookup import attr as _attr
from ppcompile.torch_internals.lookup import lookup as _lookup
from ppcompile.torch_internals.ops import OpOverload, OpOverloadPacket, qualified_op_name

__all__ = [
    "C_SCALED_DOT_PRODUCT_ATTENTION", "OpOverload", "OpOverloadPacket", "TorchInternalsError",
    "compile_id", "cuda_graph_capture", "current_shape_env", "custom_op_implementation", "custom_op_module",
    "data_dependent_errors", "dynamo_compile_start_ns", "dynamo_generation", "every_dim_dynamic",
    "floats_specialized", "frame_compile_index", "frame_id",
    "has_internal_overlap", "inductor_compile", "inductor_config_copy", "is_float_symbol",
    "last_guard_failure", "mark_dynamic", "nested_compile_region", "qualified_op_name",
    "raise_recompile_limit", "recompile_limit", "region_traces_reused", "register_backend", "reset_dynamo",
    "resolve_process_group", "restart_analysis", "restart_with_floats_specialized", "shape_check",
    "shape_env_facts", "shape_env_guards", "shape_env_hints",
    "static_fake_mode", "storage_from_data_pointer", "symint_shape_env", "sympy_interp_logger_name",
    "sympy_interp_python", "trace_artifact", "tracing_context", "tree_leaves", "without_dynamo_disable",
    "written_arguments",
]


# ------------------------------------------------------------------------- bound at import
#: Flattens nested lists, tuples and dicts (an op's ``(args, kwargs)``) to their leaves.
tree_leaves: Callable[[Any], list[Any]] = _lookup(
    "torch.utils._pytree", "tree_leaves", "to flatten op arguments")

#: ``torch._check(cond, message)``: states a relation of sizes (in a fake kernel, also to the shape env).
shape_check: Callable[..., None] = _lookup("torch", "_check", "to state shape relations in fake kernels")

#: The C function behind ``F.scaled_dot_product_attention`` (Dynamo may record either).
C_SCALED_DOT_PRODUCT_ATTENTION: Callable[..., Any] = _lookup(
    "torch._C", "_nn.scaled_dot_product_attention", "to recognise attention in traced graphs")

_internal_overlap: Callable[[torch.Tensor], int] = _lookup(
    "torch", "_debug_has_internal_overlap", "to find outputs whose elements share memory")
_sympy_interp: Callable[..., Any] = _lookup(
    "torch.utils._sympy.interp", "sympy_interp", "to evaluate symbolic sizes")
_python_reference: Any = _lookup(
    "torch.utils._sympy.reference", "PythonReferenceAnalysis", "to evaluate symbolic sizes")


def has_internal_overlap(t: torch.Tensor) -> bool:
    """Whether some elements of ``t`` share memory (``expand``'s stride 0): not a copy destination."""
    return bool(_internal_overlap(t) == 1)


def sympy_interp_python(env: Mapping[sympy.Symbol, int], expr: sympy.Basic) -> Any:
    """``expr`` evaluated with Python semantics (``FloorDiv``, ``Mod``, ...) at the values ``env``."""
    return _sympy_interp(_python_reference, dict(env), expr)


def sympy_interp_logger_name() -> str:
    """The logger torch's sympy interpreter warns through (undefined points of a sweep)."""
    return str(_sympy_interp.__module__)


# ------------------------------------------------------------------------- tensors and storage
def storage_from_data_pointer(ptr: int, device: torch.device, nbytes: int) -> torch.UntypedStorage:
    """An untyped storage over ``nbytes`` at ``ptr`` that does not own (or keep alive) the memory."""
    make = _lookup("torch._C", "_construct_storage_from_data_pointer", "for non-owning output views")
    storage: torch.UntypedStorage = make(ptr, device, nbytes)
    return storage


@contextlib.contextmanager
def cuda_graph_capture(graph: Any, pool: Any, stream: Any) -> Iterator[None]:
    """Captures the CUDA work of the block into ``graph`` on ``stream``, its memory from ``pool``.

    ``torch.cuda.graph`` without what its entry does on every capture in torch 2.11 to 2.13
    (``synchronize()``, ``empty_cache()``, the pinned host cache flush): over a ladder of buckets that is
    a flush per (segment, bucket); the caller flushes once per run of captures instead. An error raised
    in the block propagates as it is: the ``capture_end`` after a capture the block invalidated raises an
    error of its own ("operation not permitted when stream is capturing"), added to the block's as a
    note instead of replacing it. Capture mode ``"global"``, torch's default: an unsafe CUDA call from any
    thread during the capture fails it, rather than corrupting it."""
    why = "to capture CUDA graphs"
    begin = _attr(graph, "capture_begin", "torch.cuda.CUDAGraph", why)
    end = _attr(graph, "capture_end", "torch.cuda.CUDAGraph", why)
    with torch.cuda.stream(stream):
        begin(pool=pool, capture_error_mode="global")
        try:
            yield
        except BaseException as e:
            try:
                end()
            except Exception as end_error:  # the capture the block broke cannot end cleanly
                add_note(e, f"(ending the broken capture then failed too: {type(end_error).__name__}: "
                            f"{end_error})")
            raise
        end()


def mark_dynamic(t: torch.Tensor, dim: int) -> None:
    """Marks ``t``'s dimension ``dim`` dynamic for Dynamo's next trace of it."""
    _lookup("torch._dynamo", "mark_dynamic", "to mark token dims dynamic")(t, dim)


# ------------------------------------------------------------------------- shape environment
def symint_shape_env(size: torch.SymInt) -> Any:
    """The ShapeEnv a SymInt belongs to (None for a SymInt outside any)."""
    return _attr(size.node, "shape_env", "SymNode", "to simplify symbolic sizes")


def current_shape_env() -> Any:
    """The ShapeEnv of Dynamo's trace in progress, or None outside a trace."""
    ctx = _lookup("torch._guards", "TracingContext", "to reach the trace's shape env").try_get()
    if ctx is None:
        return None
    fake_mode = _attr(ctx, "fake_mode", "TracingContext", "to reach the trace's shape env")
    return None if fake_mode is None else _attr(fake_mode, "shape_env", "FakeTensorMode", "for its shape env")


def shape_env_guards(shape_env: Any) -> tuple[sympy.Basic, ...]:
    """The expressions of every guard ``shape_env`` recorded while tracing."""
    why = "to know which token counts a graph was traced for"
    return tuple(_attr(g, "expr", "ShapeGuard", why) for g in _attr(shape_env, "guards", "ShapeEnv", why))


def shape_env_facts(shape_env: Any) -> tuple[int, int, int]:
    """How many guards, replacements and divisibility facts ``shape_env`` holds ((0, 0, 0) for None):
    a compile that grows them added guards its artifact depends on."""
    if shape_env is None:
        return (0, 0, 0)
    why = "to tell whether a segment compile added shape guards (its artifact is then not shared)"
    guards, replacements, divisible = (_attr(shape_env, name, "ShapeEnv", why)
                                       for name in ("guards", "replacements", "divisible"))
    return (len(guards), len(replacements), len(divisible))


def shape_env_hints(shape_env: Any) -> dict[sympy.Symbol, Any]:
    """The traced value of each backed symbol of ``shape_env``: its own dict, not a copy."""
    hints: dict[sympy.Symbol, Any] = _attr(shape_env, "backed_var_to_val", "ShapeEnv", "for size hints")
    return hints


def is_float_symbol(symbol: sympy.Symbol) -> bool:
    """Whether ``symbol`` is one of Dynamo's float symbols (a traced Python float)."""
    why = "to tell float symbols from size symbols"
    symt = _lookup("torch.utils._sympy.symbol", "SymT.FLOAT", why)
    return bool(_lookup("torch.utils._sympy.symbol", "symbol_is_type", why)(symbol, symt))


# ------------------------------------------------------------------------- distributed
def resolve_process_group(group_name: str) -> Any:
    """The process group a functional collective names by ``group_name`` (c10d's registered name)."""
    why = "to find the process group a traced collective runs on"
    return _lookup("torch.distributed.distributed_c10d", "_resolve_process_group", why)(group_name)


# ------------------------------------------------------------------------- Dynamo
def compile_id() -> Any:
    """The id of Dynamo's compile in progress (``0/1``), or None outside one."""
    return _lookup("torch._guards", "CompileContext.current_compile_id", "to name stage graphs")()


def register_backend(fn: Callable[..., Any], name: str) -> bool:
    """Registers ``fn`` as the Dynamo backend ``name`` unless Dynamo knows it already (from the entry
    point; registering twice raises "duplicate name"); whether it did."""
    why, registry = "to register the backend by name", "torch._dynamo.backends.registry"
    if name in _lookup(registry, "_COMPILER_FNS", why) or _lookup(registry, "_BACKENDS", why).get(name):
        return False
    _lookup(registry, "register_backend", why)(fn, name=name)
    return True


def _reset_sentinel(*args: Any, **kwargs: Any) -> None:
    """A compile-start callback that does nothing: its presence says Dynamo was not reset since."""


_GENERATION = {"count": 0, "registered": False}


def dynamo_generation() -> int:
    """How many times Dynamo has been reset (``torch._dynamo.reset``) since ppcompile first asked: a
    reset clears Dynamo's compile callbacks, among them a no-op one registered here, so its absence
    marks a reset (and it is registered again)."""
    why = "to tell the stage graphs of a reset Dynamo from the live ones"
    handler = _lookup("torch._dynamo.callback", "callback_handler", why)
    if _reset_sentinel not in _attr(handler, "start_callbacks", "torch._dynamo.callback_handler", why):
        if _GENERATION["registered"]:
            _GENERATION["count"] += 1
        handler.register_start_callback(_reset_sentinel)
        _GENERATION["registered"] = True
    return _GENERATION["count"]


def reset_dynamo() -> None:
    """Forgets every compiled frame (``torch._dynamo.reset``)."""
    _lookup("torch._dynamo", "reset", "to start from no compiled frames")()


def raise_recompile_limit(limit: int) -> None:
    """Raises Dynamo's per-code-object recompile limit to at least ``limit`` (``cache_size_limit`` is
    its alias since before 2.11)."""
    config = _lookup("torch._dynamo", "config", "to raise the recompile limit")
    if _attr(config, "recompile_limit", "torch._dynamo.config", "to raise the recompile limit") < limit:
        config.recompile_limit = limit


def recompile_limit() -> int:
    """Dynamo's per-code-object recompile limit: past it, a frame whose guards fail runs uncompiled."""
    config = _lookup("torch._dynamo", "config", "to read the recompile limit")
    return int(_attr(config, "recompile_limit", "torch._dynamo.config", "to read the recompile limit"))


def last_guard_failure(frame: int) -> str | None:
    """The latest reason Dynamo recorded for recompiling frame ``frame`` (the guards of its earlier
    stage graphs that failed, ``0/0: <guard>  # <source line>``, one line per stage graph), or None.
    Read when the backend is called for a recompile, so it is that recompile's reason."""
    failures = _lookup("torch._dynamo.utils", "guard_failures", "to say why a stage graph recompiled")
    prefix = f"{frame}/"
    for reasons in failures.values():
        if reasons and str(reasons[-1]).startswith(prefix):
            return str(reasons[-1])
    return None


def frame_id(compile_id: Any) -> int | None:
    """The frame of ``compile_id`` (``0/3`` is frame 0), or None."""
    frame = getattr(compile_id, "frame_id", None)
    return frame if isinstance(frame, int) else None


def frame_compile_index(compile_id: Any) -> int | None:
    """Which compile of its frame ``compile_id`` is (0 for the first; ``0/3`` is 3), or None."""
    index = getattr(compile_id, "frame_compile_id", None)
    return index if isinstance(index, int) else None


def restart_analysis() -> type[BaseException]:
    """Dynamo's restart exception: a backend raising it makes Dynamo re-trace the frame."""
    cls: type[BaseException] = _lookup("torch._dynamo.exc", "RestartAnalysis", "to let Dynamo re-trace")
    return cls


def dynamo_compile_start_ns() -> int | None:
    """``time.time_ns()`` when Dynamo started compiling the current frame, or None outside a compile."""
    why = "to time Dynamo's trace"
    metrics = _lookup("torch._dynamo.utils", "get_metrics_context", why)()
    if not metrics.in_progress():
        return None
    start = int(_attr(metrics, "_start_time_ns", "MetricsContext", why))
    return start if start > 0 else None


def floats_specialized(names: Sequence[str]) -> bool:
    """Whether Dynamo was already asked to specialise every float symbol in ``names``."""
    state = _lookup("torch._dynamo.symbolic_convert", "TensorifyState", "to specialise float inputs")
    return all(state.should_specialize(n) for n in names)


def restart_with_floats_specialized(names: Sequence[str]) -> NoReturn:
    """Asks Dynamo to bake the floats ``names`` in as constants and re-trace (raises its restart)."""
    why = "to specialise float inputs"
    state = _lookup("torch._dynamo.symbolic_convert", "TensorifyState", why)
    restart = _lookup("torch._dynamo.exc", "TensorifyScalarRestartAnalysis", why)
    for n in names:
        state.specialize(n)
    raise restart


def without_dynamo_disable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` without the ``disable`` wrappers Dynamo put around it (a function that is no such wrapper
    comes back as is). ``functools.wraps`` copies the wrapper's attributes onto functions wrapping one;
    those stay, told apart by the wrapper's id stamp."""
    while getattr(fn, "_torchdynamo_disable", False) and getattr(fn, "_torchdynamo_wrapper_id", 0) == id(fn):
        inner = _attr(fn, "_torchdynamo_orig_callable", "a torch._dynamo.disable wrapper", "to unwrap it")
        if not callable(inner):
            break
        fn = inner
    return fn


# ------------------------------------------------------------------------- Inductor and fake tensors
def inductor_config_copy() -> dict[str, Any]:
    """Every ``torch._inductor.config`` setting and its current value."""
    config = _lookup("torch._inductor.config", "get_config_copy", "to read and check Inductor settings")()
    return dict(config)


def inductor_compile(
    gm: torch.fx.GraphModule, inputs: Sequence[Any], config_patches: Mapping[str, Any] | None = None
) -> Callable[..., Any]:
    """Inductor's ``compile_fx`` of ``gm`` over the example ``inputs``, with settings patched."""
    compile_fx = _lookup("torch._inductor.compile_fx", "compile_fx", "to compile graph segments")
    compiled: Callable[..., Any] = compile_fx(gm, list(inputs), config_patches=dict(config_patches)
                                              if config_patches else None)
    return compiled


def static_fake_mode() -> Any:
    """A fresh fake tensor mode with static shapes (no symbols)."""
    return _lookup("torch._subclasses.fake_tensor", "FakeTensorMode", "for static-shape compiles")(
        static_shapes=True)


@contextlib.contextmanager
def tracing_context(fake_mode: Any) -> Iterator[None]:
    """A tracing context of its own over ``fake_mode`` for the compiles inside it."""
    why = "for static-shape compiles"
    context = _lookup("torch._guards", "TracingContext", why)
    with _lookup("torch._guards", "tracing", why)(context(fake_mode)):
        yield


# ------------------------------------------------------------------------- ops and logging
def custom_op_module(qualname: str) -> str | None:
    """The Python module that defined the ``torch.library.custom_op`` named ``qualname`` (``ns::op``),
    or None for an op defined otherwise (``torch.library.define``, C++)."""
    fn = custom_op_implementation(qualname)
    if fn is None:
        return None
    why = "to find the module that registers a custom op"
    module = _attr(fn, "__module__", "a custom op's function", why)
    return module if isinstance(module, str) and not module.startswith("__") else None


def custom_op_implementation(qualname: str) -> Callable[..., Any] | None:
    """The Python function behind the ``torch.library.custom_op`` named ``qualname`` (``ns::op``), or
    None for an op defined otherwise (``torch.library.define``, C++)."""
    why = "to probe a custom op's implementation"
    opdef = _lookup("torch._library.custom_ops", "OPDEFS", why).get(qualname)
    if opdef is None:
        return None
    fn: Callable[..., Any] = _attr(opdef, "_init_fn", "CustomOpDef", why)
    return fn


def data_dependent_errors() -> tuple[type[Exception], type[Exception]]:
    """What a fake tensor raises for a host read of its data (``.item()``, ``.tolist()``) and for an op
    whose output size depends on the data (``nonzero``), in that order."""
    why = "to tell host reads and data-dependent shapes in a probed op"
    return (_lookup("torch._subclasses.fake_tensor", "DataDependentOutputException", why),
            _lookup("torch._subclasses.fake_tensor", "DynamicOutputShapeException", why))


def written_arguments(op: OpOverload) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument ``op``'s schema marks as written in place (``Tensor(a!)``:
    an out-variant op's ``out``, an in-place op's ``self``)."""
    why = "to find the arguments an op writes in place"
    arguments = _attr(op, "_schema.arguments", "OpOverload", why)
    return tuple((i, a.name) for i, a in enumerate(arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def trace_artifact(
    metadata_fn: Callable[[], dict[str, Any]], payload_fn: Callable[[], str], compile_id: Any = None
) -> None:
    """Emits a ``trace_structured`` artifact (``TORCH_TRACE``); ``payload_fn`` runs only when traced."""
    trace = _lookup("torch._logging", "trace_structured", "to emit TORCH_TRACE artifacts")
    trace("artifact", metadata_fn=metadata_fn, payload_fn=payload_fn, expect_trace_id=False,
          compile_id=compile_id)


def nested_compile_region(fn: Callable[..., Any], max_traces: int) -> Callable[..., Any]:
    """``torch.compiler.nested_compile_region(fn)``, allowing ``max_traces`` traces of it where this torch
    caps them (it raises past the cap; torch 2.11 has no cap and reuses no trace)."""
    region = torch.compiler.nested_compile_region
    if region_traces_reused():
        return region(fn, max_reuse_entries=max(8, max_traces))
    return region(fn)


def region_traces_reused() -> bool:
    """Whether Dynamo stamps a nested compile region's first trace out for later calls (torch 2.13)
    rather than tracing every call and sharing only identical subgraphs (torch 2.11)."""
    region = getattr(torch.compiler, "nested_compile_region", None)
    return region is not None and "max_reuse_entries" in inspect.signature(region).parameters


def every_dim_dynamic() -> bool:
    """Whether Dynamo is tracing with every dim dynamic (``torch.compile(dynamic=True)``): nested compile
    regions then fail in torch 2.13 (a fixed size handed to the region as a symbol, ``KeyError``)."""
    return not torch._dynamo.config.assume_static_by_default  # read inside a trace: no lookup helper

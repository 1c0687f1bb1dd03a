"""The private torch APIs of warm restarts: Dynamo's ahead-of-time compile, and a shape env rebuilt.

``torch.compile(...).aot_compile`` traces a function once and returns a callable that holds Dynamo's
bytecode, guards and the backend's result; serialized, it is loaded in another process without
tracing again. The backend's result must subclass :data:`SerializableCallable`. A stage graph read
back from disk gets a fresh shape env holding the traced one's symbols, size hints and guards, so
ppcompile's passes read it as they read Dynamo's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import sympy
import torch

from ppcompile.torch_internals import compile_id, shape_env_guards, shape_env_hints
from ppcompile.torch_internals.lookup import attr, lookup, missing

__all__ = [
    "SerializableCallable", "aot_compile", "aot_compiling", "aot_guard_check", "aot_traced_modules",
    "compile_recording", "dumps_aot", "fake_opaque", "fake_tensor", "load_recorded", "loads_aot",
    "new_fake_mode", "opaque_value", "operator_name", "operator_named", "shape_env_of_fake_mode",
    "shape_env_state", "symbolic_value", "traced_sources",
]

_WHY = "for warm restarts"
_T = TypeVar("_T")
# Dynamo's per-tensor dim marks (``mark_dynamic`` and kin). A reloaded guard cannot know the marks its
# trace saw and rejects any marked tensor; the marks only steer a trace, so checks run without them.
_DIM_MARKS = ("_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices", "_dynamo_unbacked_indices",
              "_dynamo_strict_unbacked_indices", "_dynamo_static_indices", "_dynamo_dynamic_range",
              "_dynamo_hint_overrides", "_dynamo_shape_ids", "_dynamo_unbacked_bounds",
              "_has_dynamo_dim_marking")

_RANGES = ("var_to_range", "var_to_range_sloc")  # each symbol's value range, and where it was set

if TYPE_CHECKING:
    from torch._dynamo.aot_compile_types import SerializableCallable
else:
    SerializableCallable = lookup("torch._dynamo.aot_compile_types", "SerializableCallable", _WHY)


def aot_compile(fn: Callable[..., Any], backend: Callable[..., Any], args: Sequence[Any],
                kwargs: Mapping[str, Any]) -> Any:
    """Dynamo's whole-graph trace of ``fn(*args, **kwargs)`` compiled by ``backend``, ahead of time.

    ``backend`` runs under the AOTAutograd settings of the caller: aot_compile forces its own (bundled,
    forced autograd caches, eager backward lowering) around the backend, which would make every
    Inductor segment compile slower and miss the caches a plain ``torch.compile`` fills and reads."""
    dynamo_config = lookup("torch._dynamo", "config", _WHY)
    functorch_config = lookup("torch._functorch", "config", _WHY)
    callers = functorch_config.get_config_copy()

    def with_callers_settings(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        now = functorch_config.get_config_copy()
        with functorch_config.patch({k: v for k, v in callers.items() if now.get(k) != v}):
            return backend(gm, example_inputs)

    with dynamo_config.patch(enable_aot_compile=True):
        compiled = torch.compile(fn, fullgraph=True, backend=with_callers_settings)
        run = attr(compiled, "aot_compile", "torch.compile(...)", _WHY)
        return run((tuple(args), dict(kwargs)))


def aot_compiling() -> bool:
    """Whether Dynamo's ahead-of-time compile (``torch.compile(...).aot_compile``, which vLLM compiles
    through by default) is calling the backend now: its result must then be a
    :data:`SerializableCallable`. Dynamo passes the backend nothing that says so. Its config switch
    ``enable_aot_compile`` only makes the API available (on by default in torch 2.13; vLLM sets it
    around ``torch.compile``, not around the compile), and the AOTAutograd settings ``aot_compile``
    forces around the backend a caller may set too (and :func:`aot_compile` takes them back). So:
    outside a compile of a running frame (Dynamo always holds a compile id there, never in an
    ahead-of-time compile's backend call), a frame of ``aot_compile_fullgraph`` (where torch 2.11 to
    2.13 call the backend) is on the stack."""
    if compile_id() is not None:
        return False
    module = sys.modules.get("torch._dynamo.aot_compile")
    if module is None:  # never imported: no ahead-of-time compile has run
        return False
    code = inspect.unwrap(attr(module, "aot_compile_fullgraph", "torch._dynamo.aot_compile", _WHY)).__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def traced_sources(shape_env: Any) -> dict[int, Any]:
    """Where Dynamo's trace over ``shape_env`` read each value it made fake, by the id of the fake value
    (a fake tensor, a SymInt): its Dynamo source (the first, for a value read by several). Dynamo's
    ahead-of-time compile calls the backend after its trace dropped each graph input's
    ``meta["grapharg"]``; the shape env's tracked fakes (kept for the guards built after the backend)
    still say where the inputs came from."""
    tracked = attr(shape_env, "tracked_fakes", "ShapeEnv", _WHY) or ()
    sources: dict[int, Any] = {}
    for fake in tracked:
        value, source = (attr(fake, name, "TrackedFake", _WHY) for name in ("fake", "source"))
        sources.setdefault(id(value), source)
    return sources


def compile_recording(compile: Callable[[], _T]) -> tuple[_T, tuple[bytes, str] | None]:
    """``compile()`` (one Inductor compile), with the cache artifacts it wrote or read (torch's
    "mega-cache" bytes) and its AOTAutograd cache key: what :func:`load_recorded` loads it from in
    another process. None when torch recorded no single artifact (its caches off, or several compiles).
    The artifacts are recorded apart from the caller's recording, then added to it, so a caller's own
    ``save_cache_artifacts()`` holds them as it would after a plain compile."""
    manager = lookup("torch.compiler._cache", "CacheArtifactManager", _WHY)
    with manager.with_fresh_cache():
        result = compile()
        recorded = {kind: list(artifacts) for kind, artifacts in _new_artifacts(manager).items()}
        saved = torch.compiler.save_cache_artifacts()
    seen = attr(manager, "_seen_artifacts", "CacheArtifactManager", _WHY)
    callers = _new_artifacts(manager)
    for kind, artifacts in recorded.items():  # what record_artifact does, for artifacts already encoded
        for artifact in artifacts:
            if artifact not in seen:
                callers[kind].append(artifact)
                seen.add(artifact)
    if saved is None:
        return result, None
    data, info = saved
    keys = list(attr(info, "aot_autograd_artifacts", "CacheInfo", _WHY))
    return result, ((data, keys[0]) if len(keys) == 1 else None)


def _new_artifacts(manager: Any) -> dict[str, list[Any]]:
    """The artifacts ``manager`` recorded since its last save, by kind."""
    artifacts: dict[str, list[Any]] = attr(manager, "_new_cache_artifacts", "CacheArtifactManager", _WHY)
    return artifacts


def load_recorded(data: bytes, key: str) -> Callable[..., Any]:
    """The compiled function :func:`compile_recording` recorded: its artifacts are put in Inductor's
    caches and the function is loaded by its key, with no graph, trace or key computation."""
    torch.compiler.load_cache_artifacts(data)
    artifact = lookup("torch._inductor.standalone_compile", "CacheCompiledArtifact", _WHY)
    load = attr(artifact, "_load_impl", "CacheCompiledArtifact", _WHY)
    loaded: Callable[..., Any] = load(contextlib.nullcontext(), key)
    return loaded


def dumps_aot(compiled: Any) -> bytes:
    """The bytes :func:`loads_aot` reads back (the backend's result serializes itself)."""
    cls = lookup("torch._dynamo.aot_compile", "AOTCompiledFunction", _WHY)
    return bytes(attr(cls.serialize(compiled), "serialized_data", "AOTCompileSaveResult", _WHY))


def loads_aot(data: bytes) -> Any:
    """A compiled function :func:`dumps_aot` wrote; its own guards are checked by :func:`aot_guard_check`
    instead (they ignore dim marks)."""
    compiled = torch.compiler.load_compiled_function(io.BytesIO(data))
    attr(compiled, "disable_guard_check", "AOTCompiledFunction", _WHY)()
    return compiled


@contextlib.contextmanager
def _without_dim_marks(values: Iterable[Any]) -> Iterator[None]:
    removed: list[tuple[torch.Tensor, str, Any]] = []
    try:
        for t in values:
            if isinstance(t, torch.Tensor):
                for name in _DIM_MARKS:
                    if name in t.__dict__:
                        removed.append((t, name, t.__dict__.pop(name)))
        yield
    finally:
        for t, name, value in removed:
            t.__dict__[name] = value


def aot_guard_check(compiled: Any, args: Sequence[Any], kwargs: Mapping[str, Any],
                    tensors: Iterable[torch.Tensor]) -> bool:
    """Whether ``compiled``'s guards pass for this call; ``tensors`` (the call's tensors) are checked
    without their dim marks, which are put back."""
    check = attr(compiled, "guard_check", "AOTCompiledFunction", _WHY)
    with _without_dim_marks(tensors):
        return bool(check(*args, **kwargs))


def aot_traced_modules(compiled: Any) -> frozenset[str]:
    """The Python modules whose code Dynamo traced into ``compiled``."""
    info = attr(compiled, "source_info", "AOTCompiledFunction", _WHY)()
    sources = attr(info, "inlined_sources", "SourceInfo", _WHY)
    return frozenset(attr(s, "module", "InlinedSource", _WHY) for s in sources)


def operator_name(target: Any) -> str | None:
    """``torch.ops.<name>`` reaches ``target`` (``aten.add.Tensor``, ``higher_order.invoke_subgraph``),
    or None for a target that is no operator."""
    ops = tuple(lookup("torch._ops", name, _WHY) for name in ("OpOverload", "OpOverloadPacket"))
    if isinstance(target, ops):
        return str(target)
    if isinstance(target, lookup("torch._ops", "HigherOrderOperator", _WHY)):
        return f"higher_order.{target.name()}"
    return None


def operator_named(name: str) -> Any:
    """The operator :func:`operator_name` named."""
    return attr(torch.ops, name, "torch.ops", _WHY)


# ------------------------------------------------------------------------- a shape env rebuilt
def shape_env_state(shape_env: Any) -> tuple[dict[Any, Any], dict[Any, Any], tuple[Any, ...], dict[str, Any]]:
    """What :func:`new_fake_mode` rebuilds of ``shape_env``, as picklable data: each backed symbol's
    traced value and value range (with where it was set), its guards' expressions, and its settings
    (Inductor's and AOTAutograd's cache keys hold them: a rebuilt shape env hits what the first
    process's compiles stored)."""
    hints = {s: v for s, v in shape_env_hints(shape_env).items() if isinstance(v, sympy.Integer)}
    ranges = {name: {s: r for s, r in attr(shape_env, name, "ShapeEnv", _WHY).items() if s in hints}
              for name in _RANGES}
    guards = shape_env_guards(shape_env)
    settings = dataclasses.asdict(attr(shape_env, "settings", "ShapeEnv", _WHY))
    return hints, ranges, guards, settings


def new_fake_mode(state: tuple[dict[Any, Any], dict[Any, Any], tuple[Any, ...], dict[str, Any]]) -> Any:
    """A fake tensor mode over a fresh shape env holding what :func:`shape_env_state` read of another."""
    hints, ranges, guards, settings = state
    shape_env = lookup("torch.fx.experimental.symbolic_shapes", "ShapeEnv", _WHY)(**settings)
    shape_env_hints(shape_env).update(hints)
    for name in _RANGES:
        attr(shape_env, name, "ShapeEnv", _WHY).update(ranges[name])
    shape_guard = lookup("torch._guards", "ShapeGuard", _WHY)
    attr(shape_env, "guards", "ShapeEnv", _WHY).extend(shape_guard(g, None, False) for g in guards)
    return lookup("torch._subclasses.fake_tensor", "FakeTensorMode", _WHY)(shape_env=shape_env)


def shape_env_of_fake_mode(fake_mode: Any) -> Any:
    """The shape env of a fake tensor mode."""
    return attr(fake_mode, "shape_env", "FakeTensorMode", _WHY)


def fake_tensor(fake_mode: Any, size: Sequence[Any], stride: Sequence[Any], offset: Any,
                dtype: torch.dtype, device: str) -> torch.Tensor:
    """A fake tensor of ``fake_mode`` with this layout (sizes may be SymInts of its shape env), made from
    a meta tensor directly rather than through the mode's dispatch (several times faster)."""
    meta = torch.empty_strided(size, stride, dtype=dtype, device="meta")
    if not isinstance(offset, int) or offset:
        meta = meta.as_strided(size, stride, offset)
    fake_class = lookup("torch._subclasses.fake_tensor", "FakeTensor", _WHY)
    return fake_class(fake_mode, meta, torch.device(device))


def opaque_value(value: Any) -> Any:
    """The real value a fake opaque object of a value type stands for (an engine's layer name that
    Dynamo lifts to a graph input: vLLM's ``LayerName``), or None for any other value."""
    if not isinstance(value, lookup("torch._library.fake_class_registry", "FakeScriptObject", _WHY)):
        return None
    try:
        real = object.__getattribute__(value, "real_obj")  # its own __getattribute__ refuses lookups
    except AttributeError as e:
        raise missing("FakeScriptObject.real_obj", _WHY) from e
    is_value_type = lookup("torch._library.opaque_object", "is_opaque_value_type", _WHY)
    return real if real is not None and is_value_type(type(real)) else None


def fake_opaque(fake_mode: Any, value: Any) -> Any:
    """The fake opaque object standing for ``value`` (an :func:`opaque_value`) in ``fake_mode``."""
    return lookup("torch._library.fake_class_registry", "maybe_to_fake_obj", _WHY)(fake_mode, value)


def symbolic_value(fake_mode: Any, expr: sympy.Basic, kind: type) -> Any:
    """A ``SymInt`` / ``SymFloat`` / ``SymBool`` (``kind``) of ``expr`` in ``fake_mode``'s shape env
    (a plain number when ``expr`` is one)."""
    pytype: type = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[kind]  # type: ignore[index]
    if not expr.free_symbols:
        return pytype(expr)
    shape_env = shape_env_of_fake_mode(fake_mode)
    try:
        hint = pytype(expr.xreplace(shape_env_hints(shape_env)))
    except (TypeError, ValueError):
        hint = None
    node = lookup("torch.fx.experimental.sym_node", "SymNode", _WHY)(expr, shape_env, pytype, hint)
    return kind(node)

"""The ``pp_breakable`` Dynamo backend: passes, segment compilation, and the stage runtime.

Found by ``torch.compile(backend="pp_breakable")`` through the ``torch_dynamo_backends`` entry point,
and registered on ``import ppcompile`` as well. Called by Dynamo's ahead-of-time compile
(``torch.compile(...).aot_compile``: ``warm_compile``, and vLLM by default), it returns the stage runtime
in a :class:`StageGraph`, which torch can serialize (``stored_graph.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ppcompile import torch_internals
from ppcompile.config import PPBreakableConfig, resolve_graph_mode
from ppcompile.counters import counters
from ppcompile.lowering import lower_stage
from ppcompile.observe.hooks import capture_observer, stage_built
from ppcompile.passes.context import PassContext
from ppcompile.passes.manager import run_passes
from ppcompile.runtime.compiled_stage import CompiledStage
from ppcompile.runtime.observer import NO_OBSERVER, CaptureRun, CaptureStart
from ppcompile.runtime.sibling_graphs import StaticCalls, input_changes, plan_static_calls
from ppcompile.runtime.stage_runtime import RECOMPILE_LIMIT, StageRuntime
from ppcompile.torch_internals.precompile import aot_compiling

from . import frame_recovery
from .graph_codec import GraphCodecError, dumps_stage_graph, restore_input_sources
from .segment_compilers import (
    compile_segments,
    compile_times,
    dynamo_trace_seconds,
    segments_skip_size_asserts,
)
from .stored_graph import StoredStageGraph
from .stored_kernels import storing_kernels
from .warm_cache import compile_fingerprint

__all__ = [
    "StageGraph", "collector_paused", "compile_stage", "pp_breakable", "runtimes_of", "serve_stage",
    "stage_runtimes", "stored_stage_graph",
]

log = logging.getLogger(__name__)

_RUNTIMES: list[tuple[weakref.ref[StageRuntime], int]] = []  # with the Dynamo generation that built it
# Per runtime (by id, while alive): the parameters and buffers its stage graph was compiled reading.
_MODULE_STATE: dict[int, weakref.WeakSet[torch.Tensor]] = {}


def stage_runtimes() -> list[StageRuntime]:
    """The stage runtimes this process has built that are still alive, oldest first; those built before
    the last ``torch._dynamo.reset()`` are left out (Dynamo no longer calls them)."""
    generation = torch_internals.dynamo_generation()
    _RUNTIMES[:] = [(ref, gen) for ref, gen in _RUNTIMES if gen == generation and ref() is not None]
    alive = [ref() for ref, _ in _RUNTIMES]
    return [rt for rt in alive if rt is not None]


def runtimes_of(module: torch.nn.Module) -> list[StageRuntime]:
    """The live stage runtimes serving ``module`` (the module, or what ``torch.compile`` returned for it),
    oldest first, recompiles included: those compiled reading its parameters or buffers, and those that
    have served it on the graph path (Dynamo may serve two instances of one class with one stage graph;
    the runtime then keeps a captured instance per module). A stage graph that reads no module state (a
    function, a module without parameters) is not found this way: use :func:`stage_runtimes`."""
    module = getattr(module, "_orig_mod", module)
    mine = {id(t) for t in (*module.parameters(), *module.buffers())}

    def serves(rt: StageRuntime) -> bool:
        compiled_for = _MODULE_STATE.get(id(rt), ())
        served = (t for state in rt.instances() for t in state.module_state)
        return any(id(t) in mine for t in (*compiled_for, *served))

    return [rt for rt in stage_runtimes() if serves(rt)]


def _check_recompile_budget(runtime: StageRuntime) -> None:
    """A fall-off ahead: this is the last compile Dynamo allows the frame, so its next guard failure runs
    the stage uncompiled (ppcompile is not called again for it; Dynamo logs one line)."""
    record = runtime.compiled.record
    done, limit = record.frame_compile, record.recompile_limit
    if done is None or limit is None or done < limit:
        return
    runtime.note_fall_off(RECOMPILE_LIMIT, (
        f"this is compile {done} of the stage's frame, Dynamo's recompile limit ({limit}): the next "
        "token count (or input) whose guards fail runs the stage uncompiled, without ppcompile. Mark the "
        "token dims (ppcompile.mark_token_dynamic) so one graph serves every count, remove the guard the "
        "model's code adds (TORCH_LOGS=recompiles names it), or raise torch._dynamo.config.recompile_limit; "
        "two modules of one class share the frame's limit"))


def _remember_state(runtime: StageRuntime, example_inputs: list[Any]) -> None:
    state: weakref.WeakSet[torch.Tensor] = weakref.WeakSet(
        x for i in runtime.compiled.state_slots if isinstance(x := example_inputs[i], torch.Tensor))
    key = id(runtime)
    _MODULE_STATE[key] = state
    weakref.finalize(runtime, _MODULE_STATE.pop, key, None)


def _lineage(stage: CompiledStage, example_inputs: list[Any]) -> CompiledStage:
    """``stage`` with the module instance it serves and the stage graph it recompiles, if any: an earlier
    stage graph of the same frame that read most of the same parameters and buffers (more than half of
    this one's: stages of one model may share a few, a rotary table) served the same module (a
    recompile); otherwise this is the frame's next module instance."""
    frame = torch_internals.frame_id(stage.record.compile_id)
    state = {id(x) for i in stage.state_slots if isinstance(x := example_inputs[i], torch.Tensor)}
    if frame is None or not state:
        return stage
    modules: dict[int, StageRuntime] = {}  # module index -> its first stage graph
    symbolic: dict[int, StageRuntime] = {}  # module index -> its first with a symbolic token count
    recompile_of = None
    for rt in stage_runtimes():
        record = rt.compiled.record
        if torch_internals.frame_id(record.compile_id) != frame or record.module is None:
            continue
        modules.setdefault(record.module, rt)
        if rt.token_symbol is not None:
            symbolic.setdefault(record.module, rt)
        shared = sum(id(t) in state for t in _MODULE_STATE.get(id(rt), ()))
        if recompile_of is None and 2 * shared > len(state):
            recompile_of = (record.module, modules[record.module].name)
    module, first = recompile_of if recompile_of is not None else (len(modules) + 1, None)
    reason = torch_internals.last_guard_failure(frame) if first is not None else None
    base = symbolic.get(module) if first else None
    changes = input_changes(base.compiled, stage) if base is not None else ()
    return dataclasses.replace(stage, record=dataclasses.replace(
        stage.record, module=module, recompile_of=first, recompile_reason=reason, input_changes=changes))


def _report_input_changes(runtime: StageRuntime) -> None:
    """A recompile for inputs of another structure than the module's first call's is named once."""
    record = runtime.compiled.record
    if not record.input_changes:
        return
    counters.input_recompiles += 1
    log.warning(
        "pp_breakable: %s compiled because a call's inputs differ in structure from the earlier calls' of "
        "its module: %s. If that call was a mistake, fix its inputs: calls that match the earlier ones are "
        "still served by their stage graph. Its first call runs eagerly, so a bad input raises the "
        "model's own error before any capture", runtime.compiled.name, "; ".join(record.input_changes))


def _link_static_siblings(new: StageRuntime) -> None:
    """Hands the calls of static stage graphs (a 1-token call's, say) to a symbolic stage graph of the same
    frame and module, which serves them from its buckets (``runtime/sibling_graphs.py``)."""
    frame, module = torch_internals.frame_id(new.compiled.record.compile_id), new.compiled.record.module
    if frame is None:
        return
    kin = [rt for rt in stage_runtimes() if torch_internals.frame_id(rt.compiled.record.compile_id) == frame
           and rt.compiled.record.module == module]
    for symbolic in (rt for rt in kin if rt.token_symbol is not None and rt.eager_reason is None):
        for static in (rt for rt in kin if rt.token_symbol is None and rt.served_by is None):
            plan = plan_static_calls(static.compiled, symbolic.compiled)
            if plan is not None:
                static.served_by = StaticCalls(symbolic.name, symbolic, plan)
                log.info("%s: the calls of %s (static sizes) are served by %s", symbolic.name, static.name,
                         symbolic.name)


def _graph_name() -> str:
    compile_id = torch_internals.compile_id()
    suffix = str(compile_id).replace("/", "_") if compile_id is not None else str(len(_RUNTIMES))
    return f"stage_graph_{suffix}"


def _nth(index: int | None) -> int | None:
    return None if index is None else index + 1


def _on_cuda(example_inputs: list[Any]) -> bool:
    return any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs)


@contextlib.contextmanager
def collector_paused() -> Iterator[bool]:
    """Python's cycle collector off inside, as it was after; yields whether it was on. The passes make
    and drop thousands of FX nodes; a collection meanwhile promotes the live ones, and enough
    promotions set off a collection of the whole process heap (torch's own objects included), which
    costs a deep stage more than any pass. Their cycles are collected after, with the next young
    generation."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield enabled
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def _collector_on(on: bool) -> Iterator[None]:
    if on:
        gc.enable()
    try:
        yield
    finally:
        if on:
            gc.disable()


def compile_stage(
    gm: torch.fx.GraphModule, example_inputs: list[Any], config: PPBreakableConfig
) -> CompiledStage:
    """One Dynamo graph of a PP stage through the passes and the segment compiles, lowered, with the
    cycle collector paused (:func:`collector_paused`) but for Inductor's segment compiles: they take
    seconds and make cycles of their own."""
    dynamo_seconds = dynamo_trace_seconds()
    name = _graph_name()
    ctx = PassContext(config=config, example_inputs=list(example_inputs), graph_name=name)
    mode = resolve_graph_mode(config.graph_mode, _on_cuda(example_inputs))
    with collector_paused() as enabled:
        split = run_passes(gm, ctx)
        counters.backend_compiles += 1  # after the passes: a re-trace a pass asked for is not a compile
        with _collector_on(enabled and config.segment_compiler != "eager"):
            compiled, segment_compiles = compile_segments(split, ctx)
        return lower_stage(
            name, split, ctx, compiled, config, mode,
            skip_size_asserts=segments_skip_size_asserts(config),
            segment_compiles=tuple(segment_compiles),
            compile_times=compile_times(dynamo_seconds, ctx, segment_compiles),
            compile_id=(compile_id := torch_internals.compile_id()),
            frame_compile=_nth(torch_internals.frame_compile_index(compile_id)),
            recompile_limit=torch_internals.recompile_limit(),
        )


def serve_stage(stage: CompiledStage, config: PPBreakableConfig, example_inputs: list[Any]) -> StageRuntime:
    """The runtime serving ``stage``, registered (``stage_runtimes``, ``runtimes_of``), reported and
    dumped; ``example_inputs``: the inputs of the call it was compiled for."""
    stage = _lineage(stage, list(example_inputs))
    built: list[weakref.ref[StageRuntime]] = []  # the runtime, for observers of its capture runs

    def observe_capture(start: CaptureStart) -> CaptureRun:
        runtime = built[0]() if built else None
        run = None if runtime is None else capture_observer(runtime, start)
        return NO_OBSERVER(start) if run is None else run

    runtime = StageRuntime(stage, config, observer=observe_capture)  # capture runs -> observe.hooks
    built.append(weakref.ref(runtime))
    _RUNTIMES.append((weakref.ref(runtime), torch_internals.dynamo_generation()))
    _remember_state(runtime, example_inputs)
    _check_recompile_budget(runtime)
    _report_input_changes(runtime)
    _link_static_siblings(runtime)
    stage_built(runtime)  # ppcompile.debug: split/segment dumps, report, TORCH_TRACE
    log.info("%s", runtime.describe())
    return runtime


def pp_breakable(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    options: Mapping[str, Any] | None = None,
    **_: Any,
) -> Callable[..., Any]:
    """Compiles one Dynamo graph of a PP stage into a ``StageRuntime`` (a graph of a function that a stage
    frame calls while Dynamo runs that frame uncompiled after a failed recompile runs as traced:
    ``frame_recovery.py``); under Dynamo's ahead-of-time compile, into a :class:`StageGraph` holding
    the runtime (:func:`stored_stage_graph`)."""
    if aot_compiling():
        return stored_stage_graph(gm, example_inputs, options)
    return _stage_runtime(gm, example_inputs, options)


def _stage_runtime(gm: torch.fx.GraphModule, example_inputs: list[Any],
                   options: Mapping[str, Any] | None) -> Callable[..., Any]:
    compile_id = torch_internals.compile_id()
    frame = torch_internals.frame_id(compile_id)
    frame_recovery.note_backend_call(frame, torch_internals.frame_compile_index(compile_id))
    if frame_recovery.inside_a_recovered_stage():
        return frame_recovery.passthrough(gm)
    config = PPBreakableConfig.from_options(options)
    stage = compile_stage(gm, example_inputs, config)
    runtime = serve_stage(stage, config, [*example_inputs, *stage.bound_inputs])
    frame_recovery.note_stage_frame(frame, runtime.name)
    return runtime


class StageGraph(StoredStageGraph):
    """A stage runtime torch can serialize (``stored_graph.py``); read back, compiled and served by this
    backend."""

    def _compile(self, gm: torch.fx.GraphModule, args: list[Any], config: PPBreakableConfig) -> CompiledStage:
        return compile_stage(gm, args, config)

    def _serve(self, stage: CompiledStage, config: PPBreakableConfig, args: list[Any]) -> StageRuntime:
        return serve_stage(stage, config, args)


def stored_stage_graph(gm: torch.fx.GraphModule, example_inputs: list[Any],
                       options: Mapping[str, Any] | None) -> Callable[..., Any]:
    """The backend's result as Dynamo's ahead-of-time compile needs it: the stage runtime in a
    :class:`StageGraph` with Dynamo's graph as it came (its inputs' sources put back, then written before
    the passes, which rewrite it), its Inductor segments keeping what a restart loads them from. A
    function of a stage frame running uncompiled (``frame_recovery.py``) is returned as it is: it is not
    stored."""
    restore_input_sources(gm)
    try:
        graph, why = dumps_stage_graph(gm), None
    except GraphCodecError as e:
        graph, why = None, str(e)
    except Exception as e:  # a codec bug: the stage still compiles and serves, it is not stored
        log.warning("pp_breakable: the stage graph cannot be stored (%s: %s)", type(e).__name__, e)
        graph, why = None, f"{type(e).__name__}: {e}"
    with storing_kernels():
        runtime = _stage_runtime(gm, example_inputs, options)
    if not isinstance(runtime, StageRuntime):
        return runtime
    return StageGraph(graph, options, runtime, why, fingerprint=compile_fingerprint(runtime.config))

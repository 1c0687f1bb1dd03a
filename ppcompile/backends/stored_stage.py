"""A lowered stage (``CompiledStage``) to bytes and back, for warm restarts that skip the passes.

A restart that reads back the Dynamo graph (``graph_codec``) still rebuilds every node's fake value and
runs the passes and the lowering again. What they produce is plain data (segments, slots, bucket plan,
size expressions, layouts) plus the segments' callables. When each of those is a graph module's code
(eager segments, and the break segments of any stage) or an Inductor kernel whose cache artifacts torch
recorded (``stored_kernels``), the whole ``CompiledStage`` pickles, and a restart serves it as it is.
Graph modules travel as their nodes (``graph_codec``) without node metadata, so the split module kept
for dumps and diagnoses comes back without fake values.

Any other callable (a kernel compiled with Inductor's caches off, one specialised to a bucket by
``compile_sizes``, a Python function) is refused with ``StoredStageError``: such a stage is stored as
its Dynamo graph only and compiled again on restart. The record keeps the split module, the segment
compiles and the region traces; the first process's compile id and times are not carried (the
restart's record says how long reading it back took). A stage with Inductor kernels also carries the
answer of Inductor's CPU vector-ISA probe (``torch_internals.cpu_isa``), which the restart adopts
before it loads them when it holds there, instead of probing again.
"""

from __future__ import annotations

import copyreg
import dataclasses
import functools
import io
import pickle
import types
from collections.abc import Mapping
from typing import Any

import torch

from ppcompile.lowering.program import SingleOutput
from ppcompile.runtime.compiled_stage import CompiledStage, CompileRecord
from ppcompile.torch_internals.cpu_isa import ProbedVecIsas, adopt_vec_isas, probed_vec_isas

from .graph_codec import graph_from_records, graph_records
from .stored_kernels import StoredKernel, load_kernel

__all__ = ["StoredStageError", "dumps_compiled_stage", "loads_compiled_stage"]

_FORMAT = "ppcompile-compiled-stage-2"


class StoredStageError(ValueError):
    """A lowered stage that cannot be stored or read back (the restart then compiles its graph)."""


def _frozen(mapping: dict[Any, Any]) -> Mapping[Any, Any]:
    return types.MappingProxyType(mapping)


def _graph_module(records: list[tuple[Any, ...]], attrs: dict[str, Any]) -> torch.fx.GraphModule:
    """The graph module of ``records``. Its child graph modules (a split module's segments) are already
    built, each its code compiled: they are set after the parent's code is generated, since generating
    it would compile every child's again."""
    children = {t: m for t, m in attrs.items() if isinstance(m, torch.fx.GraphModule)}
    gm = torch.fx.GraphModule({**attrs, **{t: torch.nn.Module() for t in children}},
                              graph_from_records(records))
    for target, child in children.items():
        *path, name = target.split(".")
        setattr(functools.reduce(getattr, path, gm), name, child)
    return gm


class _StagePickler(pickle.Pickler):
    """Read-only mappings as such; a graph module as its nodes and the attributes they name (its own
    ``__reduce__`` writes its code, which reading back traces again: several times slower); an Inductor
    kernel as its recorded artifacts and key (``stored_kernels``)."""

    dispatch_table = {**copyreg.dispatch_table, types.MappingProxyType: lambda m: (_frozen, (dict(m),))}

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, StoredKernel):
            return load_kernel, (obj.artifacts, obj.key, obj.single_output)
        if not isinstance(obj, torch.fx.GraphModule):
            return NotImplemented
        named = {str(n.target) for n in obj.graph.nodes if n.op in ("get_attr", "call_module")}
        attrs = {t: functools.reduce(getattr, t.split("."), obj) for t in named}
        return _graph_module, (graph_records(obj.graph), attrs)


def _bare(fn: Any) -> Any:
    return fn.fn if isinstance(fn, SingleOutput) else fn


def _storable(fn: Any) -> bool:
    """``fn`` (bare, or returning its one output in a tuple) is a graph module's generated ``forward``
    or an Inductor kernel with its recorded artifacts."""
    fn = _bare(fn)
    if isinstance(fn, StoredKernel):
        return True
    return isinstance(fn, types.MethodType) and isinstance(fn.__self__, torch.fx.GraphModule) \
        and fn.__name__ == "forward"


def dumps_compiled_stage(stage: CompiledStage) -> bytes:
    """``stage`` as bytes; ``StoredStageError`` when a part of it cannot be stored."""
    kernels = False
    for step in stage.program.steps:
        for fn in (step.fn, step.call):
            if fn is not None and not _storable(fn):
                raise StoredStageError(f"segment {step.segment.name} runs {fn!r}, neither a graph module's "
                                       "code nor an Inductor kernel torch recorded")
            kernels = kernels or isinstance(_bare(fn), StoredKernel)
    record = stage.record
    kept = CompileRecord(split_module=record.split_module, segment_compiles=record.segment_compiles,
                         region_traces=record.region_traces)
    buffer = io.BytesIO()
    try:
        pickler = _StagePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.dump((_FORMAT, probed_vec_isas() if kernels else None))  # read first: adopted before loads
        pickler.dump(dataclasses.replace(stage, record=kept))
    except Exception as e:  # a value pickle refuses (a fake tensor, a lock, a local class)
        raise StoredStageError(f"{type(e).__name__}: {e}") from e
    return buffer.getvalue()


def loads_compiled_stage(data: bytes) -> CompiledStage:
    """The stage ``dumps_compiled_stage`` wrote; ``StoredStageError`` when the bytes do not hold one."""
    reader = pickle.Unpickler(io.BytesIO(data))
    try:
        header = reader.load()
    except Exception as e:
        raise StoredStageError(f"{type(e).__name__}: {e}") from e
    fmt = header[0] if isinstance(header, tuple) and header else header
    if fmt != _FORMAT or len(header) != 2 or not isinstance(header[1], (ProbedVecIsas, type(None))):
        raise StoredStageError(f"not a stored stage of this ppcompile ({fmt!r:.80})")
    adopt_vec_isas(header[1])
    try:
        stage = reader.load()
    except Exception as e:
        raise StoredStageError(f"{type(e).__name__}: {e}") from e
    if not isinstance(stage, CompiledStage):
        raise StoredStageError(f"not a stored stage of this ppcompile ({type(stage).__name__} in it)")
    return stage

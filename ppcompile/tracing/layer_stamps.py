"""Stamped layers: Dynamo traces one layer of a group; each other layer reaches the graph as one op.

``trace_layers_once(stage)`` gives every layer of a group of alike layers a class of ppcompile's, a
subclass of its own (``Stamped<Class>``), whose ``forward`` while Dynamo traces does one of three things:

- **exemplar** (the group's first layer called in the trace with this layout of arguments): runs its own
  code, traced op by op as in a flat trace, between ``ppcompile::layer_input`` and
  ``ppcompile::layer_output`` markers (its inputs are copies, written back after it);
- **stamp** (every later layer of the group with that layout): one ``ppcompile::stamped_layer`` op
  whose traced outputs are the exemplar's, so Dynamo does not trace the layer's code;
- **flat** (a layer whose check failed, a second call of the exemplar, or arguments it does not lay
  out): its own code, traced op by op.

The fake kernel of ``ppcompile::stamped_layer`` checks the layer against the exemplar while Dynamo
traces (``layer_stamp_checks``): the same traced input sizes, and the same ops when both run on meta
tensors. A layer that fails it is traced flat right after the call, which nothing then reads.
Python constants that differ (a global layer id) are allowed only as arguments of custom ops; the
backend's ``expand_stamped_layers`` pass substitutes them when it copies the exemplar's ops for the
layer, wired to the layer's own inputs and weights. So the stage graph the other passes see is a flat
trace's.

Dynamo's graph, layer 5 stamped from layer 4::

    copy = ppcompile.layer_input(l_hidden_, 'g0/layers.4', 0)
    ... layer 4's ops on copy and l_self_modules_layers_modules_4_..., attention(q, k, v, 4) ...
    h4 = ppcompile.layer_output(out, 'g0/layers.4', 0)
    stamped = ppcompile.stamped_layer([h4], 'g0/layers.5', 'T');  h5 = stamped[0]

Other backends run ``stamped_layer`` as the layer's own ``forward`` on copies of its inputs (a layer
that writes its input is never stamped). A refused layer's call, which nothing reads, is dropped by
backends that remove dead code (``aot_eager``, ``inductor``); ``eager`` runs it. Outside
``torch.compile`` the layers run their own ``forward``.

The stamping ``forward`` is the class's, not an instance attribute: Dynamo then calls it straight, where
an instance ``forward`` makes it trace ``nn.Module.__call__`` and its hook checks for every layer. The
``nn.ModuleList`` holding a group gets a subclass too, whose indexing Dynamo traces in a few steps. A
copy (``copy.deepcopy``, pickling) of either is a plain module of its own class.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ppcompile.torch_internals import every_dim_dynamic
from ppcompile.torch_internals.tracing import trace_attempt
from ppcompile.tracing.layer_stamp_checks import (
    LAYER_CLASS,
    Substitution,
    compare_layers,
    decode_arguments,
    encode_arguments,
    own_forward,
    tensor_key,
)
from ppcompile.tracing.marker_ops import region_write_back

__all__ = ["StampFacts", "install_stamps", "is_stamped", "layer_name", "layer_of", "stamp_facts"]

log = logging.getLogger(__name__)

_LAYERS: dict[str, weakref.ref[nn.Module]] = {}  # handle -> layer
_GROUP_OF: dict[str, str] = {}  # handle -> its group's name
_GROUPS = 0
_HANDLE = "_ppcompile_stamp"  # a stamped layer's attribute: its handle
_SUBCLASSES: dict[tuple[type[nn.Module], str], type[nn.Module]] = {}  # (class, method) -> subclass


@dataclasses.dataclass
class StampFacts:
    """What the checks decided for one stamped layer: the exemplar it copies and the constants to
    substitute in the copy."""

    exemplar: str
    substitutions: tuple[Substitution, ...]


@dataclasses.dataclass
class _Trace:
    """What one Dynamo trace attempt learnt: each group's exemplar, its inputs, outputs and layout."""

    attempt: str
    exemplar: dict[str, str] = dataclasses.field(default_factory=dict)  # group and layout -> handle
    inputs: dict[str, dict[int, torch.Tensor]] = dataclasses.field(default_factory=dict)
    outputs: dict[str, dict[int, torch.Tensor]] = dataclasses.field(default_factory=dict)
    out_layout: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    stamped: dict[str, StampFacts] = dataclasses.field(default_factory=dict)
    rejected: dict[str, str] = dataclasses.field(default_factory=dict)  # handle -> why it traced flat


_TRACE: _Trace | None = None
_ALL_TENSORS = tuple("|".join("T" * n) for n in range(16))  # encode_arguments's layout of n tensors


def _trace() -> _Trace | None:
    global _TRACE
    attempt = trace_attempt()
    if attempt is None:
        return None
    if _TRACE is None or _TRACE.attempt != attempt:
        _TRACE = _Trace(attempt)
    return _TRACE


def layer_of(handle: str) -> nn.Module:
    """The live layer ``handle`` names; raises ``RuntimeError`` if it is gone."""
    ref = _LAYERS.get(handle)
    layer = ref() if ref is not None else None
    if layer is None:
        raise RuntimeError(f"ppcompile: stamped layer {handle!r} no longer exists")
    return layer


def is_stamped(module: nn.Module) -> bool:
    """Whether ``module`` is a layer ``trace_layers_once`` stamped."""
    return vars(type(module)).get("forward") is _stamped_forward


def layer_name(handle: str) -> str:
    """The stage's name of the layer ``handle`` names (``layers.5`` for ``g0/layers.5``)."""
    return handle.partition("/")[2]


def stamp_facts() -> tuple[dict[str, StampFacts], dict[str, str]]:
    """The stamped layers of the Dynamo trace in progress (handle -> facts) and the layers whose check
    failed (handle -> why); empty outside a trace."""
    state = _trace()
    return ({}, {}) if state is None else (dict(state.stamped), dict(state.rejected))


def install_stamps(names: Sequence[str], modules: Sequence[nn.Module], container: nn.Module) -> str | None:
    """Gives each of ``modules`` (alike layers of one class, ``names`` in the stage, held by
    ``container``) the stamping ``forward``, and an ``nn.ModuleList`` container quick indexing; returns
    why it cannot (their class cannot be subclassed), changing nothing, or None."""
    global _GROUPS
    try:
        layer_class = _subclass(type(modules[0]), "forward", _stamped_forward)
    except Exception as e:  # a class whose __init_subclass__ refuses, say
        return f"its class cannot be subclassed ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    group = f"g{_GROUPS}"
    _GROUPS += 1
    for name, module in zip(names, modules):
        handle = f"{group}/{name}"
        _LAYERS[handle] = weakref.ref(module)
        _GROUP_OF[handle] = group
        setattr(module, _HANDLE, handle)
        module.__class__ = layer_class
    if getattr(type(container), "__getitem__", None) is nn.ModuleList.__getitem__:
        with contextlib.suppress(Exception):  # quick indexing only saves trace time
            container.__class__ = _subclass(type(container), "__getitem__", _module_list_item)
    return None


def _subclass(cls: type[nn.Module], name: str, method: Any) -> type[nn.Module]:
    """``cls``'s subclass ``Stamped<cls>`` with ``method`` as its ``name`` (one per class and method);
    ``cls`` itself if it is one (a module holding a stamped stage stamped again)."""
    if LAYER_CLASS in vars(cls):
        return cls
    made = _SUBCLASSES.get((cls, name))
    if made is None:
        namespace = {name: method, "__reduce_ex__": _reduce_as_own_class, LAYER_CLASS: cls,
                     "__module__": __name__, "__doc__": f"{cls.__qualname__}, stamped by trace_layers_once."}
        metaclass: Any = type(cls)  # a layer class's own metaclass, if it has one, makes its subclass
        made = _SUBCLASSES[cls, name] = metaclass(f"Stamped{cls.__name__}", (cls,), namespace)
    return made


def _module_list_item(self: nn.ModuleList, index: Any) -> Any:
    """``nn.ModuleList.__getitem__``, with a quick path for an index in range (an engine's
    ``self.layers[i]``): Dynamo traces a few steps where it traces about sixty for the general one."""
    if type(index) is int and 0 <= index < len(self._modules):
        return self._modules[str(index)]  # a ModuleList's keys are its indices
    return nn.ModuleList.__getitem__(self, index)


def _reduce_as_own_class(self: nn.Module, protocol: Any) -> Any:
    """Pickles (and deep-copies) a stamped layer or container as a plain one of its own class, without
    a handle; loading it needs no ppcompile."""
    state = self.__getstate__()
    if isinstance(state, dict):
        state = {k: v for k, v in state.items() if k != _HANDLE}
    return object.__new__, (getattr(type(self), LAYER_CLASS),), state


# ------------------------------------------------------------------------------------------ at trace time
@torch.compiler.assume_constant_result
def _role(handle: str, layout: str) -> str:
    """``"exemplar"`` for the first layer of its group called with ``layout`` in this trace, ``"stamp"``
    for the others, ``"flat"`` for the exemplar called again (or outside a trace)."""
    state = _trace()
    if state is None or every_dim_dynamic():
        return "flat"
    kind = _kind(handle, layout)
    if kind not in state.exemplar:
        state.exemplar[kind] = handle
        return "exemplar"
    return "flat" if state.exemplar[kind] == handle else "stamp"  # an exemplar called again: flat


def _kind(handle: str, layout: str) -> str:
    """Layers of a group called with one layout of arguments share an exemplar (a hybrid's layer class
    takes other arguments in its attention layers than in its linear-attention ones)."""
    return f"{_GROUP_OF[handle]}|{layout}"


@torch.compiler.assume_constant_result
def _note_out_layout(handle: str, kind: str, mask: str) -> bool:
    state = _trace()
    if state is not None:
        state.out_layout[handle] = (kind, mask)
    return True


@torch.compiler.assume_constant_result
def _stamped_output(handle: str, layout: str) -> tuple[str, str]:
    """How the exemplar of stamped layer ``handle`` laid its output out (:func:`_refill`'s ``kind`` and
    ``mask``); ``("", "")`` when the check kept ``handle`` flat."""
    state = _trace()
    if state is None or handle not in state.stamped:
        return "", ""
    return state.out_layout[state.exemplar[_kind(handle, layout)]]


def _stamped_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Every stamped class's ``forward``: one function for all of them, so Dynamo guards each layer on
    its handle alone. A stamped layer's path reads nothing else of the layer (its own class's
    ``forward`` neither: Dynamo would guard it)."""
    if not torch.compiler.is_compiling():
        return own_forward(self)(self, *args, **kwargs)
    handle: str = getattr(self, _HANDLE)
    positional = not kwargs and len(args) < len(_ALL_TENSORS)
    for x in args:  # a loop here: Dynamo would inline a call of all() as a function of its own
        positional = positional and isinstance(x, torch.Tensor)
    if positional:
        # An engine's call (positional tensors): Dynamo folds this test and the lookup, where it would
        # trace encode_arguments's loop instruction by instruction.
        encoded: tuple[str, list[torch.Tensor]] | None = (_ALL_TENSORS[len(args)], list(args))
    else:
        encoded = encode_arguments(args, kwargs)
    if encoded is None or not encoded[1]:
        return own_forward(self)(self, *args, **kwargs)
    layout, tensors = encoded
    role = _role(handle, layout)
    if role == "flat":
        return own_forward(self)(self, *args, **kwargs)
    if role == "exemplar":
        marked = [layer_input(x, handle, i) for i, x in enumerate(tensors)]
        copies = iter(marked)
        out = own_forward(self)(self, *_swap_tensors(args, copies), **dict(zip(kwargs, _swap_tensors(
            tuple(kwargs.values()), copies))))
        for x, copy in zip(tensors, marked):  # the layer may have written its input's copy
            region_write_back(x, copy)
        return _mark_outputs(handle, out)
    outs = _STAMPED(tensors, handle, layout)  # its fake kernel checks the layer first
    kind, mask = _stamped_output(handle, layout)
    if not kind:  # the check failed: the call above has no users, and expand_stamped_layers drops it
        return own_forward(self)(self, *args, **kwargs)
    if kind == "T":
        return outs[0]
    if "N" not in mask:  # no None in the output: built here, where Dynamo would inline _refill
        return tuple(outs) if kind == "tuple" else list(outs)
    return _refill(kind, mask, outs)


def _swap_tensors(values: tuple[Any, ...], new: Any) -> list[Any]:
    """``values`` with each tensor (at the top level or in a tuple or list) replaced by ``next(new)``;
    written out for Dynamo, which traces it per call."""
    out: list[Any] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(next(new))
        elif type(v) in (tuple, list):
            out.append(type(v)(next(new) if isinstance(x, torch.Tensor) else x for x in v))
        else:
            out.append(v)
    return out


def _mark_outputs(handle: str, out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        _note_out_layout(handle, "T", "T")
        return layer_output(out, handle, 0)
    if type(out) not in (tuple, list) or not all(v is None or isinstance(v, torch.Tensor) for v in out):
        _note_out_layout(handle, "other", "")
        return out
    kind, mask = type(out).__name__, "".join("T" if isinstance(v, torch.Tensor) else "N" for v in out)
    _note_out_layout(handle, kind, mask)
    tensors = [v for v in out if isinstance(v, torch.Tensor)]
    return _refill(kind, mask, [layer_output(t, handle, i) for i, t in enumerate(tensors)])


def _refill(kind: str, mask: str, tensors: Sequence[torch.Tensor]) -> Any:
    """A layer's output from its tensors: the tensor itself (``kind`` "T"), or a tuple or list (``kind``)
    with a tensor where ``mask`` has "T" and None where it has "N"."""
    if kind == "T":
        return tensors[0]
    left = iter(tensors)
    values = [next(left) if m == "T" else None for m in mask]
    return tuple(values) if kind == "tuple" else values


# ------------------------------------------------------------------------------------------ ops
@torch.library.custom_op("ppcompile::layer_input", mutates_args=())
def layer_input(x: torch.Tensor, handle: str, index: int) -> torch.Tensor:
    """A copy of input ``index`` of the exemplar layer ``handle``: marks where its traced ops begin.
    ``expand_stamped_layers`` replaces each call by ``x``."""
    return x.clone()


@layer_input.register_fake
def _(x: torch.Tensor, handle: str, index: int) -> torch.Tensor:
    state = _trace()
    if state is not None:
        state.inputs.setdefault(handle, {})[index] = x
    return torch.empty_like(x)


@torch.library.custom_op("ppcompile::layer_output", mutates_args=())
def layer_output(x: torch.Tensor, handle: str, index: int) -> torch.Tensor:
    """A copy of output ``index`` of the exemplar layer ``handle``: marks where its traced ops end."""
    return x.clone()


@layer_output.register_fake
def _(x: torch.Tensor, handle: str, index: int) -> torch.Tensor:
    state = _trace()
    if state is not None:
        state.outputs.setdefault(handle, {})[index] = x
    return torch.empty_like(x)


def _check(state: _Trace, handle: str, layout: str, inputs: Sequence[torch.Tensor]) -> str | None:
    exemplar = state.exemplar[_kind(handle, layout)]
    name, ex_name = layer_name(handle), layer_name(exemplar)
    if state.out_layout.get(exemplar, ("other", ""))[0] == "other":
        return f"{ex_name} returns something other than a tensor or a tuple or list of tensors"
    ex_inputs = state.inputs.get(exemplar, {})
    for i, x in enumerate(inputs):  # keyed now: the trace may have unified symbols since the exemplar's
        theirs = tensor_key(ex_inputs[i]) if i in ex_inputs else None
        if theirs != tensor_key(x):
            return f"its input {i} is {tensor_key(x)}, {ex_name}'s is {theirs}"
    verdict = compare_layers(layer_of(exemplar), layer_of(handle), layout, inputs, (ex_name, name))
    if isinstance(verdict, str):
        return verdict
    state.stamped[handle] = StampFacts(exemplar, verdict)
    return None


@torch.library.custom_op("ppcompile::stamped_layer", mutates_args=())
def stamped_layer(inputs: list[torch.Tensor], handle: str, layout: str) -> list[torch.Tensor]:
    """Layer ``handle``'s ``forward`` on copies of ``inputs`` (arguments laid out as ``layout``), its
    tensor outputs copied. ``expand_stamped_layers`` replaces each call by the layer's own ops."""
    layer = layer_of(handle)
    args, kwargs = decode_arguments(layout, [x.clone() for x in inputs])
    out = own_forward(layer)(layer, *args, **kwargs)
    outs = [out] if isinstance(out, torch.Tensor) else [v for v in out if isinstance(v, torch.Tensor)]
    return [o.clone() for o in outs]


@stamped_layer.register_fake
def _(inputs: list[torch.Tensor], handle: str, layout: str) -> list[torch.Tensor]:
    state = _trace()
    if state is None:
        raise RuntimeError("ppcompile::stamped_layer has no fake outputs outside the trace that made it")
    if handle not in state.stamped and handle not in state.rejected:
        why = _check(state, handle, layout, inputs)
        if why is None:
            log.debug("stamped layer %s", handle)
        else:
            state.rejected[handle] = why
            log.info("trace_layers_once: %s is traced flat: %s", layer_name(handle), why)
    outputs = state.outputs[state.exemplar[_kind(handle, layout)]]
    return [torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device)
            for _, o in sorted(outputs.items())]


# Called as OpOverloads in traced code: Dynamo puts one straight in the graph, where it would trace a
# CustomOpDef's Python ``__call__``.
_STAMPED = torch.ops.ppcompile.stamped_layer.default

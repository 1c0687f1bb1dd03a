"""Whether a layer may be stamped from its group's exemplar: both run on small fake tensors, op by op.

Each layer's ``forward`` runs on fake tensors of static sizes (the traced call's sizes) under a mode
that records every op the dispatcher sees, with each tensor argument named by its role: an input, the
output of an earlier op, a weight of the layer (by name), or another tensor (by identity). Two layers
may share one trace when their records agree everywhere except Python constants passed to custom ops
(a global layer id handed to attention), and their ops return the same sizes; the constants are
returned as substitutions. A later layer's record replays the exemplar's: an op that matches the
exemplar's at its place gives back what the exemplar's returned, without running a kernel. Anything else that
differs (an op, a shape, a constant passed to a torch op, a branch taken on a layer's attribute) keeps
the layer to a flat trace, with the first difference as the reason. Python effects that run no op (a
layer appending to a list) are not seen.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ppcompile.torch_internals import static_fake_mode, tree_leaves, written_arguments
from ppcompile.torch_internals.tracing import (
    as_if_compiling,
    dispatch_mode,
    outside_fake_mode,
    python_dispatcher_off,
    real_tensors_allowed,
    shares_storage,
    size_hint,
    tree_flatten,
    tree_unflatten,
)

__all__ = ["LAYER_CLASS", "Substitution", "compare_layers", "decode_arguments", "encode_arguments",
           "named_state", "own_forward", "tensor_key"]

LAYER_CLASS = "_ppcompile_layer_class"  # a stamped layer's class (ppcompile's subclass) -> the layer's own

_TORCH_NAMESPACES = frozenset({"aten", "prims", "prim", "_c10d_functional", "c10d_functional"})
_CANNOT_RUN = "cannot run on"
_SCALARS = (int, float, bool)
_Record = tuple[tuple[str, tuple[Any, ...]], ...]
_OP_FACTS: dict[Any, tuple[str, tuple[tuple[int, str], ...], bool]] = {}
_EXEMPLAR_RECORDS: weakref.WeakKeyDictionary[nn.Module, dict[Any, _Recording | str]] = \
    weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class Substitution:
    """In the copy of the exemplar's ops: argument ``index`` (``name``) of the ``occurrence``-th call of
    custom op ``op`` is ``new`` instead of the exemplar's ``old``."""

    op: str
    occurrence: int
    index: int
    name: str
    old: Any
    new: Any


def tensor_key(x: torch.Tensor) -> tuple[Any, ...]:
    """A tensor's traced metadata as plain values: sizes and strides (symbolic ones as text), dtype,
    device."""
    return (tuple(str(s) for s in x.shape), tuple(str(s) for s in x.stride()), x.dtype, x.device)


def encode_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, list[torch.Tensor]] | None:
    """``forward``'s arguments as one layout string and their tensors, in order: ``"T|=None|(T,T)|k:=2"``
    is ``f(t, None, (a, b), k=2)``. None if an argument is neither a tensor, None, an int, float or bool,
    nor a plain tuple or list of those. Dynamo traces this on every stamped call: written flat, it
    inlines no helper for the common arguments."""
    keys = [""] * len(args)
    if kwargs:
        keys += [f"{k}:" for k in kwargs]
    tokens: list[str] = []
    tensors: list[torch.Tensor] = []
    for key, value in zip(keys, [*args, *kwargs.values()]):
        if isinstance(value, torch.Tensor):
            tokens.append(key + "T")
            tensors.append(value)
        elif value is None or type(value) in _SCALARS:
            tokens.append(key + "=" + repr(value))
        elif type(value) in (tuple, list) and (text := _sequence_token(value, tensors)) is not None:
            tokens.append(key + text)
        else:
            return None
    return "|".join(tokens), tensors


def _sequence_token(value: tuple[Any, ...] | list[Any], tensors: list[torch.Tensor]) -> str | None:
    inner: list[str] = []
    for v in value:
        if isinstance(v, torch.Tensor):
            inner.append("T")
            tensors.append(v)
        elif v is None or type(v) in _SCALARS:
            inner.append("=" + repr(v))
        else:
            return None
    return ("(" if type(value) is tuple else "[") + ",".join(inner) + ")"


def decode_arguments(layout: str, tensors: Sequence[Any]) -> tuple[list[Any], dict[str, Any]]:
    """The ``(args, kwargs)`` that :func:`encode_arguments` laid out, with ``tensors`` in its tensors'
    places."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    at = [0]
    for token in layout.split("|") if layout else []:
        key, text = ("", token) if token[0] in "T=([" else token.split(":", 1)
        if text[0] in "([":
            items = [_value(t, tensors, at) for t in text[1:-1].split(",") if t]
            value: Any = tuple(items) if text[0] == "(" else items
        else:
            value = _value(text, tensors, at)
        if key:
            kwargs[key] = value
        else:
            args.append(value)
    return args, kwargs


def _value(text: str, tensors: Sequence[Any], at: list[int]) -> Any:
    if text == "T":
        at[0] += 1
        return tensors[at[0] - 1]
    return ast.literal_eval(text[1:])


def own_forward(layer: nn.Module) -> Any:
    """The ``forward`` of ``layer``'s own class, also for a stamped layer (whose class is a subclass
    ``layer_stamps`` made, with a stamping ``forward``)."""
    cls = type(layer)
    return getattr(cls, LAYER_CLASS, cls).forward


def named_state(layer: nn.Module) -> dict[str, torch.Tensor]:
    """``layer``'s parameters and buffers by name, shared ones under each of their names."""
    return dict([*layer.named_parameters(remove_duplicate=False),
                 *layer.named_buffers(remove_duplicate=False)])


def compare_layers(
    exemplar: nn.Module, layer: nn.Module, layout: str, inputs: Sequence[torch.Tensor], names: tuple[str, str]
) -> tuple[Substitution, ...] | str:
    """The substitutions that turn ``exemplar``'s ops into ``layer``'s, or why there are none.
    ``inputs``: the layer's traced (fake) inputs; ``names``: the two layers' names, for the reason."""
    static = tuple((tuple(size_hint(s) for s in x.shape), tuple(size_hint(s) for s in x.stride()),
                    x.dtype, x.device) for x in inputs)
    cached = _EXEMPLAR_RECORDS.setdefault(exemplar, {})
    key = (layout, static)
    if key not in cached:  # meta tensors are fastest; code that branches on the device may need fakes
        cached[key] = _record(exemplar, layout, static, on_meta=True)
        if isinstance(cached[key], str) and str(cached[key]).startswith(_CANNOT_RUN):
            cached[key] = _record(exemplar, layout, static, on_meta=False)
    theirs = cached[key]
    if isinstance(theirs, str):
        return f"{names[0]} {theirs}"
    on_meta = theirs.ops[0][0] == "meta"
    ours = _record(layer, layout, static, on_meta, guide=theirs if on_meta else None)
    if isinstance(ours, str):
        return ours
    verdict = _diff(theirs, ours, names)
    if not isinstance(verdict, str) and ours.left_guide:  # out of step, and yet alike: record it plainly
        plain = _record(layer, layout, static, on_meta)
        return plain if isinstance(plain, str) else _diff(theirs, plain, names)
    return verdict


@dataclasses.dataclass
class _Recording:
    """A layer's record (its weights, then each op with the roles of its arguments, then what it
    returns), what each op returned (:meth:`_Recorder.returned`), and whether a replay left it."""

    ops: _Record
    returned: list[tuple[Any, list[Any]]]
    left_guide: bool


def _record(layer: nn.Module, layout: str, static: Sequence[tuple[Any, ...]], on_meta: bool,
            guide: _Recording | None = None) -> _Recording | str:
    """``layer``'s ops on meta tensors of the ``static`` sizes (real tensors it reads, its weights
    included, are read as meta copies), or on fake tensors of its own device, with the roles of their
    tensor arguments; run as if compiling, as Dynamo runs it. With a ``guide`` (the exemplar's recording
    on meta tensors), an op that matches the guide's op at its place returns what that op returned,
    without running (see :class:`_Recorder`)."""
    state = named_state(layer)
    kind = "meta" if on_meta else "fake"
    try:
        with outside_fake_mode(), as_if_compiling(), contextlib.ExitStack() as stack:
            if on_meta:  # meta kernels need no Python dispatcher; with it each op costs several times more
                stack.enter_context(python_dispatcher_off())
            else:
                mode = stack.enter_context(static_fake_mode())
                stack.enter_context(real_tensors_allowed(mode))
            inputs = [torch.empty_strided(size, stride, dtype=dtype, device="meta" if on_meta else device)
                      for size, stride, dtype, device in static]
            recorder = _Recorder(state, inputs, on_meta, guide)
            args, kwargs = decode_arguments(layout, inputs)
            with recorder:
                out = own_forward(layer)(layer, *args, **kwargs)
    except Exception as e:  # any failure keeps the layer flat; the reason says what failed
        return f"{_CANNOT_RUN} {kind} tensors ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    if recorder.written:  # stamped, its op would run on copies under other backends and lose the write
        return f"writes its input {min(recorder.written)} in place"
    weights = tuple((name, tuple(t.shape), t.stride(), t.dtype, t.device) for name, t in state.items())
    returned = ("return", tuple(recorder.role(v) for v in tree_leaves(out)))
    return _Recording(((kind, weights), *recorder.ops, returned), recorder.returned,
                      left_guide=guide is not None and recorder.guide is None)


class _Recorder(dispatch_mode()):  # type: ignore[misc]
    """Records each op with the roles of its arguments: an input, a weight (by name), the output of an
    earlier op (by order), another tensor (by identity), or the value itself.

    Replaying a ``guide``: while every op so far has matched the guide's op at its place (its name and
    roles, or a custom op whose output sizes come out the same), an op that matches returns fresh meta
    tensors of the sizes the guide's op returned (or the tensors it returned of its arguments) instead
    of running. Ops whose output sizes depend on more than their roles (a custom op given another
    constant) and torch ops that write an argument (``unsqueeze_`` changes sizes) always run. On the
    first op that does not match, the guide is dropped and every later op runs."""

    def __init__(self, state: dict[str, torch.Tensor], inputs: Sequence[torch.Tensor], on_meta: bool,
                 guide: _Recording | None) -> None:
        super().__init__()
        self.on_meta = on_meta
        self.guide = guide
        self.named: dict[tuple[str, Any], torch.Tensor] = {("in", i): x for i, x in enumerate(inputs)}
        self.named.update((("w", name), t) for name, t in state.items())
        self.names: dict[int, tuple[str, Any]] = {id(x): role for role, x in self.named.items()}
        self.meta: dict[int, torch.Tensor] = {}  # a real tensor's id -> the meta copy ops read instead
        # Every tensor seen stays alive, so that no id is reused: ``named`` holds the inputs, weights and
        # op outputs, ``alive`` the real tensors ops read as meta copies.
        self.alive: list[Any] = []
        self.ops: list[tuple[str, tuple[Any, ...]]] = []
        self.returned: list[tuple[Any, list[Any]]] = []
        self.inputs = list(inputs)
        self.written: set[int] = set()  # inputs an op wrote in place (through a view too)

    def _meta(self, value: Any) -> Any:
        if not self.on_meta:
            return value
        if isinstance(value, torch.Tensor):
            if value.device.type == "meta":
                return value
            if id(value) not in self.meta:
                self.meta[id(value)] = value.to("meta")
                self.alive.append(value)
            return self.meta[id(value)]
        if isinstance(value, (list, tuple)):
            return type(value)(self._meta(v) for v in value)
        if isinstance(value, dict):
            return {k: self._meta(v) for k, v in value.items()}
        return value

    def role(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            role = self.names.get(id(value))
            if role is None:
                role = ("other", id(value))
                self.named[role] = value
            return role
        if isinstance(value, (list, tuple)):
            return tuple(self.role(v) for v in value)
        return value

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name, written, always_runs = _op_facts(func)
        roles = tuple(self.role(a) for a in args) + tuple((k, self.role(v)) for k, v in kwargs.items())
        step = len(self.ops)
        self.ops.append((name, roles))
        theirs = self.guide.ops[step + 1] if self.guide is not None and step + 2 < len(self.guide.ops) \
            else None
        if theirs == (name, roles) and not always_runs:
            spec, leaves = self.guide.returned[step]  # type: ignore[union-attr]
            out = tree_unflatten([self._replayed(v) for v in leaves], spec)
        else:
            out = func(*self._meta(args), **self._meta(kwargs))
            for position, argument in written:
                value = args[position] if position < len(args) else kwargs.get(argument)
                if isinstance(value, torch.Tensor):
                    self.written.update(i for i, x in enumerate(self.inputs) if shares_storage(value, x))
        leaves, spec = tree_flatten(out)
        returned = [self._returned(v) for v in leaves]
        self.returned.append((spec, returned))
        if self.guide is not None and (theirs is None or theirs[0] != name
                                       or returned != self.guide.returned[step][1]):
            self.guide = None
        for t in leaves:
            if isinstance(t, torch.Tensor) and id(t) not in self.names:
                self.names[id(t)] = ("v", len(self.named))
                self.named[("v", len(self.named))] = t
        return out

    def _returned(self, value: Any) -> Any:
        """What an op returned, as a replay gives it back: a tensor it was given (by role), a new
        tensor (by sizes, strides and dtype) or a value."""
        if not isinstance(value, torch.Tensor):
            return ("value", value)
        if id(value) in self.names:
            return ("named", self.names[id(value)])
        return ("new", tuple(value.shape), value.stride(), value.dtype)

    def _replayed(self, returned: Any) -> Any:
        kind, *rest = returned
        if kind == "value":
            return rest[0]
        if kind == "named":
            return self.named[rest[0]]
        shape, stride, dtype = rest
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")


def _op_facts(func: Any) -> tuple[str, tuple[tuple[int, str], ...], bool]:
    """An op's name, the arguments it writes, and whether a replay must run it (a torch op that writes
    an argument may change its sizes)."""
    facts = _OP_FACTS.get(func)
    if facts is None:
        name, written = str(func.name()), written_arguments(func)
        facts = _OP_FACTS[func] = (name, written, bool(written) and name.split("::")[0] in _TORCH_NAMESPACES)
    return facts


def _diff(exemplar: _Recording, layer: _Recording, names: tuple[str, str]) -> tuple[Substitution, ...] | str:
    theirs, ours = exemplar.ops, layer.ops
    if theirs[0] != ours[0]:
        mine, other = dict((w[0], w[1:]) for w in ours[0][1]), dict((w[0], w[1:]) for w in theirs[0][1])
        name = next((n for n in {**mine, **other} if mine.get(n) != other.get(n)), "?")
        return f"its weight {name!r} is {_weight(mine.get(name))}, {names[0]}'s {_weight(other.get(name))}"
    if len(theirs) != len(ours):
        return f"it runs {len(ours) - 2} ops, {names[0]} {len(theirs) - 2}"
    subs: list[Substitution] = []
    seen: dict[str, int] = {}
    for step, ((op, a), (op2, b)) in enumerate(zip(theirs[1:], ours[1:])):
        occurrence = seen[op] = seen.get(op, -1) + 1
        if op != op2:
            return f"it calls {op2} where {names[0]} calls {op}"
        if a != b:
            if len(a) != len(b):
                return f"its call of {op} takes {len(b)} arguments, {names[0]}'s {len(a)}"
            namespace = op.split("::")[0]
            for i, (x, y) in enumerate(zip(a, b)):
                if x == y:
                    continue
                plain = all(type(v) in (int, float, bool, str) for v in (x, y))
                if op == "return" or namespace in _TORCH_NAMESPACES or not plain:
                    return f"its call of {op} differs from {names[0]}'s in argument {i} ({y!r} vs {x!r})"
                subs.append(Substitution(op, occurrence, i, _argument_name(op, i), x, y))
        if op != "return" and layer.returned[step][1] != exemplar.returned[step][1]:
            # the copy of the exemplar's ops would carry the exemplar's sizes
            return f"its call of {op} returns {_sizes(layer.returned[step][1])}, {names[0]}'s " \
                f"{_sizes(exemplar.returned[step][1])}"
    return tuple(subs)


def _sizes(returned: list[Any]) -> str:
    return ", ".join(str(list(r[1])) if r[0] == "new" else repr(r[1]) for r in returned)


def _weight(meta: Any) -> str:
    if meta is None:
        return "missing"
    shape, stride, dtype, device = meta
    return f"{list(shape)} (strides {list(stride)}, {dtype}, {device})"


def _argument_name(op: str, index: int) -> str:
    namespace, _, rest = op.partition("::")
    name, _, overload = rest.partition(".")
    packet = getattr(getattr(torch.ops, namespace), name)
    schema = getattr(packet, overload or "default")._schema
    return str(schema.arguments[index].name) if index < len(schema.arguments) else str(index)

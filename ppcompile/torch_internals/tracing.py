"""The private torch APIs of stamped layers (``ppcompile.tracing.layer_stamps``): which trace is running, and
running a layer's code on meta tensors from inside it.

A stamped layer's checks run while Dynamo traces the stage: they key what they learn by the trace
attempt (a restarted trace starts afresh), step out of the trace's fake mode, and record a layer's ops
at the dispatcher.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ppcompile.torch_internals import shape_env_hints, symint_shape_env
from ppcompile.torch_internals.lookup import attr, lookup

__all__ = [
    "as_if_compiling", "dispatch_mode", "free_symbols", "global_state_ops", "has_default_codegen",
    "lazy_graph_module", "outside_fake_mode", "python_dispatcher_off", "real_tensors_allowed",
    "shares_storage", "size_hint", "trace_attempt", "tree_flatten", "tree_unflatten",
]

_WHY = "to stamp repeated layers out"
_SPLIT = "to split a stage graph into segments"


def trace_attempt() -> str | None:
    """Names the Dynamo trace attempt in progress (compile id and attempt), or None outside one."""
    trace = lookup("torch._guards", "CompileContext.current_trace_id", _WHY)()
    return None if trace is None else str(trace)


def outside_fake_mode() -> contextlib.AbstractContextManager[Any]:
    """Within: no fake tensor mode is active (a fake op's implementation running real or meta ops)."""
    cm: contextlib.AbstractContextManager[Any] = lookup(
        "torch._subclasses.fake_tensor", "unset_fake_temporarily", _WHY)()
    return cm


@contextlib.contextmanager
def real_tensors_allowed(fake_mode: Any) -> Iterator[None]:
    """Within: ops under ``fake_mode`` take real tensors (a layer's own weights) and fake them."""
    before = fake_mode.allow_non_fake_inputs
    fake_mode.allow_non_fake_inputs = True
    try:
        yield
    finally:
        fake_mode.allow_non_fake_inputs = before


@contextlib.contextmanager
def as_if_compiling() -> Iterator[None]:
    """Within: ``torch.compiler.is_compiling()`` is True, so code that branches on it (HF's MoE experts)
    runs as Dynamo traces it."""
    module = lookup("torch", "compiler", _WHY)
    before = attr(module, "_is_compiling_flag", "torch.compiler", _WHY)
    module._is_compiling_flag = True
    try:
        yield
    finally:
        module._is_compiling_flag = before


def python_dispatcher_off() -> contextlib.AbstractContextManager[Any]:
    """Within: ops dispatch without the Python dispatcher, which Dynamo's trace turns on (a real or meta
    op then runs its C++ kernels at C++ speed)."""
    cm: contextlib.AbstractContextManager[Any] = lookup("torch._C", "_DisablePythonDispatcher", _WHY)()
    return cm


def dispatch_mode() -> type:
    """The base class of a mode that sees every op at the dispatcher. Its subclasses' handlers run as
    they are: torch would wrap each in a Dynamo-disabling frame, which costs several us an op, and a
    mode that never runs under Dynamo's frame evaluation does not need."""
    base: type = lookup("torch.utils._python_dispatch", "TorchDispatchMode", _WHY)
    attr(base, "_should_skip_dynamo", "TorchDispatchMode", _WHY)  # the hook below overrides it
    return _UNWRAPPED.setdefault(base, type("DispatchMode", (base,), {
        "_should_skip_dynamo": classmethod(lambda cls: False), "__module__": __name__}))


_UNWRAPPED: dict[type, type] = {}



def size_hint(size: Any) -> int:
    """The value a traced size (int or SymInt) had in the call being traced."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    expr = attr(size, "node", "SymInt", _WHY).expr
    return int(expr.xreplace(shape_env_hints(symint_shape_env(size))))


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of one storage (meta tensors included, which have no data)."""
    return bool(lookup("torch._C", "_is_alias_of", _WHY)(a, b))


def tree_flatten(value: Any) -> tuple[list[Any], Any]:
    """An op's output (a tensor, or nested tuples and lists of them) as its leaves and the spec
    :func:`tree_unflatten` rebuilds it from."""
    flat: tuple[list[Any], Any] = lookup("torch.utils._pytree", "tree_flatten", _WHY)(value)
    return flat


def tree_unflatten(leaves: list[Any], spec: Any) -> Any:
    """The value :func:`tree_flatten` took apart, with ``leaves`` in its leaves' places."""
    return lookup("torch.utils._pytree", "tree_unflatten", _WHY)(leaves, spec)


def lazy_graph_module(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A ``GraphModule`` of ``graph`` whose Python code is generated when first read or run, not at
    each ``recompile()``: a pass's output that the next passes only read the graph of."""
    cls = lookup("torch.fx._lazy_graph_module", "_LazyGraphModule", "to defer a graph's code generation")
    gm: torch.fx.GraphModule = cls(root, graph)
    return gm


def free_symbols(value: Any) -> set[Any]:
    """The sympy symbols of a traced value's sizes, strides and numbers (empty for None)."""
    if value is None:
        return set()
    found: set[Any] = lookup("torch.fx.experimental.symbolic_shapes", "free_symbols", _SPLIT)(value)
    return found


def global_state_ops() -> tuple[Any, ...]:
    """The calls that switch grad mode or autocast in a Dynamo graph, which a split carries into every
    partition they span."""
    return (lookup("torch.amp", "_enter_autocast", _SPLIT), lookup("torch.amp", "_exit_autocast", _SPLIT),
            lookup("torch._C", "_set_grad_enabled", _SPLIT))


def has_default_codegen(graph: torch.fx.Graph) -> bool:
    """Whether ``graph`` generates its Python code with FX's default ``CodeGen`` (no pytree-flattened
    signature or other custom code generation), which makes code a function of the nodes alone."""
    return type(graph._codegen) is torch.fx.graph.CodeGen

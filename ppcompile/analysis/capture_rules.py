"""What real CUDA graph capture rejects, op by op: the rules ``check_capture_safety`` applies.

A capture records kernels on a stream without running them. An op that needs a device value on the
host while it is recorded (``.item()``, ``.tolist()``, an output whose size depends on the data), that
copies between host and device memory (a pageable copy, a device-to-host sync), or that draws from a
generator the capture does not know, invalidates the capture. ``CaptureRules.problem`` names the reason
for one FX node, or returns None:

- torch and aten ops by name (:data:`HOST_READ_OPS`, plus ``where`` with only a condition,
  ``repeat_interleave`` with tensor repeats and no ``output_size``, ``histc`` whose range is read from the
  data), and any op given its own ``generator``;
- a node whose output lives on another kind of device than a tensor it reads (a 0-d CPU tensor is a
  kernel argument, not a copy);
- a ``torch.library.custom_op`` whose Python implementation does one of the above: it is run once on
  fake tensors of the traced shapes (no data), where a host read or a data-dependent size raises.
  C++ ops cannot be probed: one that syncs belongs in the ``split_ops`` option.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ppcompile.symbolic import SizeFn, example_value, size_expr, size_hints
from ppcompile.torch_internals import (
    OpOverload,
    OpOverloadPacket,
    custom_op_implementation,
    data_dependent_errors,
    qualified_op_name,
    static_fake_mode,
    tree_leaves,
)

__all__ = ["HOST_READ_OPS", "CaptureRules"]

log = logging.getLogger(__name__)

_SYNC = "reads a device value on the host (a sync)"
_DATA_SIZE = "makes an output whose size depends on the data (a sync)"

#: torch functions, tensor methods and aten ops (by name) that no capture can hold, and why.
HOST_READ_OPS: dict[str, str] = {
    "item": _SYNC, "_local_scalar_dense": _SYNC, "tolist": _SYNC, "numpy": _SYNC,
    "nonzero": _DATA_SIZE, "argwhere": _DATA_SIZE, "masked_select": _DATA_SIZE, "unique": _DATA_SIZE,
    "_unique": _DATA_SIZE, "_unique2": _DATA_SIZE, "unique_dim": _DATA_SIZE, "unique_consecutive": _DATA_SIZE,
    "bincount": _DATA_SIZE,
}


def _torch_name(node: torch.fx.Node) -> str | None:
    """The name rules match for a tensor method, a torch function or an aten/prims op; None for other
    callables (a user's op named ``item`` is not torch's)."""
    target = node.target
    if node.op == "call_method":
        return str(target)
    if (qualname := qualified_op_name(target)) is not None:
        return qualname.split("::")[1] if qualname.startswith(("aten::", "prims::")) else None
    module = getattr(target, "__module__", None) or ""
    return getattr(target, "__name__", None) if module == "torch" or module.startswith("torch.") else None


def _arg(node: torch.fx.Node, index: int, name: str) -> Any:
    """Argument ``index`` (a method's self is ``args[0]``, as a function's first input) or kwarg ``name``."""
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if len(node.args) > index else None


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.fx.Node) and isinstance(example_value(value), torch.Tensor)


def _by_name(node: torch.fx.Node, name: str) -> str | None:
    if name in HOST_READ_OPS:
        return HOST_READ_OPS[name]
    if name == "where" and len(node.args) + len(node.kwargs) == 1:
        return f"with only a condition (nonzero) {_DATA_SIZE}"
    if name == "repeat_interleave":
        repeats = _arg(node, 1, "repeats")
        if (repeats is None or _is_tensor(repeats)) and _arg(node, 3, "output_size") is None:
            return f"with tensor repeats and no output_size {_DATA_SIZE}"
    if name == "histc":
        low, high = _arg(node, 2, "min"), _arg(node, 3, "max")
        if (low or 0) == (high or 0):
            return "with min == max reads the data's range on the host (a sync)"
    return None


def _crosses_devices(node: torch.fx.Node) -> str | None:
    value = example_value(node)
    if not isinstance(value, torch.Tensor):
        return None
    for arg in node.all_input_nodes:
        src = example_value(arg)
        if not isinstance(src, torch.Tensor) or src.device.type == value.device.type:
            continue
        if src.device.type == "cpu" and src.dim() == 0:
            continue  # a host scalar: passed to the kernel by value
        if src.device.type == "cpu":
            return f"copies {arg.name} from host memory to {value.device.type} (a pageable copy)"
        return f"copies {arg.name} from {src.device.type} to host memory (a sync)"
    return None


def _concrete(value: Any) -> Any:
    """A traced value at its traced sizes: a fake tensor of the traced shape, a size as its hint; raises
    ``ValueError`` for what has no concrete stand-in."""
    if isinstance(value, torch.Tensor):
        shape = [SizeFn(size_expr(s))(_hints(s)) for s in value.shape]
        return torch.empty(shape, dtype=value.dtype, device=value.device)
    if isinstance(value, torch.SymInt):
        return SizeFn(size_expr(value))(_hints(value))
    if isinstance(value, (torch.SymFloat, torch.SymBool)):
        raise ValueError("a traced float or bool")
    return value


def _hints(size: Any) -> dict[Any, int]:
    hints = size_hints(size)
    if any(v is None for v in hints.values()):
        raise ValueError("a size without a hint")
    return {s: v for s, v in hints.items() if v is not None}


def _probe(fn: Callable[..., Any], node: torch.fx.Node) -> str | None:
    """Runs ``fn`` (a custom op's implementation) on fake tensors of ``node``'s traced arguments."""
    host_read, data_size = data_dependent_errors()

    def stand_in(a: Any) -> Any:
        return _concrete(example_value(a)) if isinstance(a, torch.fx.Node) else a

    with static_fake_mode():
        try:
            args = torch.fx.node.map_aggregate(node.args, stand_in)
            kwargs = torch.fx.node.map_aggregate(node.kwargs, stand_in)
            fn(*args, **kwargs)
        except host_read:
            return f"its implementation {_SYNC}"
        except data_size:
            return f"its implementation {_DATA_SIZE}"
        except Exception as e:  # cannot run on fake tensors: nothing known against it
            log.debug("capture rules: cannot probe %s on fake tensors: %s: %s", node.target,
                      type(e).__name__, e)
    return None


_HOST_READS = frozenset(name for name, why in HOST_READ_OPS.items() if why is _SYNC)


class CaptureRules:
    """Judges the nodes of one graph in order (:meth:`problem`). ``host_inputs``: placeholders that hold
    host memory on every device (the Python numbers Dynamo passes as 0-d CPU tensors); a CPU value made
    only from them is host memory too, and reading it on the host is no sync. Probes of custom ops are
    memoised by op and argument shapes."""

    def __init__(self, host_inputs: Iterable[torch.fx.Node] = ()) -> None:
        self._probed: dict[tuple[Any, ...], str | None] = {}
        self._host = set(host_inputs)

    def _note_host(self, node: torch.fx.Node) -> None:
        value = example_value(node)
        inputs = node.all_input_nodes
        if (inputs and all(a in self._host for a in inputs)
                and (not isinstance(value, torch.Tensor) or value.device.type == "cpu")):
            self._host.add(node)

    def problem(self, node: torch.fx.Node) -> str | None:
        """Why a CUDA graph cannot capture ``node``, or None; call it on every node in graph order."""
        if node.op not in ("call_function", "call_method"):
            return None
        self._note_host(node)
        name = _torch_name(node)
        if name in _HOST_READS and node.args and node.args[0] in self._host:
            return None  # a Python number passed as a tensor: read on the host, baked into the graph
        why = _by_name(node, name) if name is not None else None
        if why is None and node.kwargs.get("generator") is not None:
            why = "draws from a generator of its own, which the capture does not register"
        if why is None:
            why = _crosses_devices(node)
        if why is None and isinstance(node.target, (OpOverload, OpOverloadPacket)) and name is None:
            why = self._custom(node)
        return why

    def _custom(self, node: torch.fx.Node) -> str | None:
        qualname = qualified_op_name(node.target)
        fn = None if qualname is None else custom_op_implementation(qualname)
        if fn is None:
            return None
        leaves = tree_leaves((node.args, node.kwargs))
        values = (example_value(a) for a in leaves if isinstance(a, torch.fx.Node))
        shapes = tuple(tuple(map(size_expr, v.shape)) if isinstance(v, torch.Tensor) else None
                       for v in values)
        key = (qualname, shapes)
        if key not in self._probed:
            self._probed[key] = _probe(fn, node)
        return self._probed[key]



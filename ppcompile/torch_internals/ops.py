"""Torch's op objects as graphs hold them: the overload and packet types, and an op's qualified name."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ppcompile.torch_internals.lookup import lookup

__all__ = ["OpOverload", "OpOverloadPacket", "op_schema", "qualified_op_name"]

if TYPE_CHECKING:
    from torch._ops import OpOverload, OpOverloadPacket
else:
    OpOverload = lookup("torch._ops", "OpOverload", "to match graph targets against ops")
    OpOverloadPacket = lookup("torch._ops", "OpOverloadPacket", "to match graph targets against ops")


def qualified_op_name(target: Any) -> str | None:
    """``"ns::name"`` of a torch op, given as an overload or its packet (``aten.add.Tensor`` ->
    ``"aten::add"``), or None for any other callable."""
    if isinstance(target, OpOverload):
        target = target.overloadpacket
    return str(target._qualified_op_name) if isinstance(target, OpOverloadPacket) else None


def op_schema(target: Any) -> Any:
    """The ``FunctionSchema`` of a torch op, given as an overload or its packet (its first overload's), or
    None for any other callable."""
    if isinstance(target, OpOverloadPacket):
        target = getattr(target, target.overloads()[0])
    return target._schema if isinstance(target, OpOverload) else None

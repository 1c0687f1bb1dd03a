"""ppcompile.torch_internals.precompile: every entry works on the installed torch."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import sympy
import torch

from ppcompile.torch_internals import precompile as pc


class _Kept(pc.SerializableCallable):
    """The smallest backend result aot_compile accepts: the graph module, stored as nothing."""

    def __init__(self, gm: torch.fx.GraphModule | None) -> None:
        self.gm = gm

    @classmethod
    def serialize_compile_artifacts(cls, fn: Any) -> bytes:
        return b"kept"

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> Any:
        assert data == b"kept"
        return cls(None)

    def __call__(self, *args: Any) -> Any:
        assert self.gm is not None
        return self.gm(*args)


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_aot_compile_stores_loads_and_checks_guards_ignoring_dim_marks() -> None:
    x = torch.randn(4, 3)
    torch._dynamo.mark_dynamic(x, 0)
    compiled = pc.aot_compile(_double, lambda gm, inputs: _Kept(gm), (x,), {})
    assert torch.equal(compiled(x), x * 2)
    assert __name__ in pc.aot_traced_modules(compiled)
    loaded = pc.loads_aot(pc.dumps_aot(compiled))
    y = torch.randn(7, 3)
    torch._dynamo.mark_dynamic(y, 0)
    assert pc.aot_guard_check(loaded, (y,), {}, [y])  # a marked tensor passes a reloaded guard
    assert y._dynamo_dynamic_indices == {0}  # and keeps its marks  # type: ignore[attr-defined]
    assert not pc.aot_guard_check(loaded, (torch.randn(7, 5),), {}, [])  # another width: guarded
    assert not pc.aot_guard_check(loaded, (torch.randn(7, 3, dtype=torch.float64),), {}, [])


def test_a_shape_env_rebuilt_and_its_values(fresh_dynamo: None) -> None:
    x = torch.randn(6, 4)
    torch._dynamo.mark_dynamic(x, 0)
    states: list[Any] = []

    def backend(gm: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        from ppcompile.torch_internals import current_shape_env

        states.append(pc.shape_env_state(current_shape_env()))
        return gm.forward

    torch.compile(lambda t: t + 1, backend=backend, fullgraph=True)(x)
    hints, ranges, _, settings = states[0]
    assert "specialize_zero_one" in settings
    ((s, hint),) = hints.items()  # the token dim's symbol
    assert hint == 6 and set(ranges["var_to_range"]) == {s}
    fake_mode = pc.new_fake_mode(states[0])
    size = pc.symbolic_value(fake_mode, s, torch.SymInt)
    assert isinstance(size, torch.SymInt) and str(size) == str(s)
    assert pc.shape_env_of_fake_mode(fake_mode) is size.node.shape_env
    assert dataclasses.asdict(size.node.shape_env.settings) == settings
    assert pc.symbolic_value(fake_mode, sympy.Integer(3), torch.SymInt) == 3
    t = pc.fake_tensor(fake_mode, [size, 4], [4, 1], 4, torch.float16, "cpu")
    assert type(t).__name__ == "FakeTensor" and t.fake_mode is fake_mode
    assert (str(t.shape[0]), t.shape[1], t.stride(), t.storage_offset(), t.dtype) == (
        str(s), 4, (4, 1), 4, torch.float16)


def test_operators_by_name() -> None:
    for op in (torch.ops.aten.add.Tensor, torch.ops.aten.add, torch.ops.higher_order.invoke_subgraph):
        name = pc.operator_name(op)
        assert name is not None and pc.operator_named(name) is op
    assert pc.operator_name(operator.add) is None

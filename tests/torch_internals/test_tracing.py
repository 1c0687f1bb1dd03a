"""ppcompile.torch_internals.tracing: every entry works on the installed torch."""

from __future__ import annotations

from typing import Any

import torch

from ppcompile.torch_internals import static_fake_mode
from ppcompile.torch_internals.tracing import (
    as_if_compiling,
    dispatch_mode,
    lazy_graph_module,
    outside_fake_mode,
    real_tensors_allowed,
    shares_storage,
    size_hint,
    trace_attempt,
    tree_flatten,
    tree_unflatten,
)


def test_trace_attempt_names_the_trace_in_progress() -> None:
    seen: list[Any] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        seen.append(trace_attempt())  # a backend runs inside the trace
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda t: t + 1, backend=backend)(torch.randn(2))
    assert trace_attempt() is None
    assert seen and seen[0] is not None and seen[0].startswith("0/0")


def test_size_hint_of_ints_and_symbols() -> None:
    hints: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        for node in gm.graph.find_nodes(op="placeholder"):
            value = node.meta.get("example_value")
            if isinstance(value, torch.Tensor):
                hints.extend(size_hint(s) for s in value.shape)
        return gm.forward

    torch._dynamo.reset()
    x = torch.randn(5, 3)
    torch._dynamo.mark_dynamic(x, 0)
    torch.compile(lambda t: t * 2, backend=backend)(x)
    assert hints == [5, 3] and size_hint(7) == 7


def test_fake_modes_and_storage() -> None:
    mode = static_fake_mode()
    weight = torch.randn(3)
    with mode, real_tensors_allowed(mode):
        y = torch.empty(3) + weight  # a real tensor taken by a fake op
        with outside_fake_mode():
            assert not isinstance(torch.empty(1), type(y))
    assert mode.allow_non_fake_inputs is False
    base = torch.empty(4, 4, device="meta")
    assert shares_storage(base[:, 1], base) and not shares_storage(torch.empty(4, device="meta"), base)


def test_as_if_compiling_and_the_dispatch_mode() -> None:
    assert not torch.compiler.is_compiling()
    with as_if_compiling():
        assert torch.compiler.is_compiling()
    assert not torch.compiler.is_compiling()
    seen: list[str] = []

    class Names(dispatch_mode()):  # type: ignore[misc]
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            seen.append(str(func.name()))
            return func(*args, **(kwargs or {}))

    with Names():
        torch.empty(2, device="meta").relu()
    assert "aten::relu" in seen
    # The handler runs as written: not in a frame that disables Dynamo (several us an op).
    assert not hasattr(Names.__dict__["__torch_dispatch__"], "__wrapped__")


def test_an_op_output_flattens_and_rebuilds() -> None:
    a, b = torch.empty(1), torch.empty(2)
    leaves, spec = tree_flatten((a, [b, 3]))
    assert leaves == [a, b, 3]
    rebuilt = tree_unflatten([b, a, 4], spec)
    assert rebuilt[0] is b and rebuilt[1][0] is a and rebuilt[1][1] == 4 and isinstance(rebuilt[1], list)


def test_a_lazy_graph_module_writes_its_code_when_run() -> None:
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    graph = gm.graph.__deepcopy__()
    (add,) = [n for n in graph.nodes if n.op == "call_function"]
    add.args = (add.args[0], 2)
    lazy = lazy_graph_module(gm, graph)
    lazy.recompile()
    assert torch.equal(lazy(torch.zeros(2)), torch.full((2,), 2.0))
    assert "+ 2" in lazy.code

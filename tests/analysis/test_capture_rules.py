"""``capture_rules``: what CUDA graph capture rejects, judged on single traced nodes (the pass that marks
them, ``check_capture_safety``, is tested under tests/passes)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ppcompile.analysis.capture_rules import CaptureRules


def _node(graph: torch.fx.Graph, target: object, *args: object, method: bool = False,
          value: object = None, **kwargs: object) -> torch.fx.Node:
    node = graph.create_node("call_method" if method else "call_function", target, args, kwargs)  # type: ignore[arg-type]
    node.meta["example_value"] = value
    return node


def _placeholder(graph: torch.fx.Graph, name: str, value: object) -> torch.fx.Node:
    node = graph.placeholder(name)
    node.meta["example_value"] = value
    return node


def test_op_rules() -> None:
    graph = torch.fx.Graph()
    with FakeTensorMode():
        x = _placeholder(graph, "x", torch.empty(6, 8))
        eps = _placeholder(graph, "eps", torch.empty((), dtype=torch.float64))
        host = _placeholder(graph, "host", torch.empty(6, 8))
        on_gpu = _placeholder(graph, "on_gpu", torch.empty(6, 8, device="cuda"))
        ints = torch.empty(6, dtype=torch.long)
        cases = {
            "nonzero": (_node(graph, torch.nonzero, x, value=ints), "depends on the data"),
            "item": (_node(graph, "item", x, method=True), "reads a device value"),
            "item of eps": (_node(graph, "item", eps, method=True), None),
            "where(cond)": (_node(graph, torch.where, x, value=ints), "nonzero"),
            "where(c, a, b)": (_node(graph, torch.where, x, x, x, value=torch.empty(6, 8)), None),
            "repeat_interleave(t)": (_node(graph, torch.repeat_interleave, x, x, value=ints), "output_size"),
            "repeat_interleave(t, size)": (_node(graph, torch.repeat_interleave, x, x, output_size=12,
                                                 value=ints), None),
            "repeat_interleave(int)": (_node(graph, torch.repeat_interleave, x, 2, value=ints), None),
            "histc": (_node(graph, torch.histc, x, 4, value=ints), "min == max"),
            "histc with range": (_node(graph, torch.histc, x, 4, 0, 3, value=ints), None),
            "rand with generator": (_node(graph, torch.rand, 6, generator=object(), value=ints), "generator"),
            "host to device": (_node(graph, "to", host, "cuda", method=True,
                                     value=torch.empty(6, 8, device="cuda")), "from host memory"),
            "device to host": (_node(graph, "cpu", on_gpu, method=True, value=torch.empty(6, 8)),
                               "to host memory"),
            "host scalar on the device": (_node(graph, torch.mul, on_gpu, eps,
                                                value=torch.empty(6, 8, device="cuda")), None),
            "aten nonzero": (_node(graph, torch.ops.aten.nonzero.default, x, value=ints), "depends"),
        }
    rules = CaptureRules(host_inputs=[eps])
    got = {name: rules.problem(node) for name, (node, _) in cases.items()}
    for name, (_, want) in cases.items():
        if want is None:
            assert got[name] is None, f"{name}: {got[name]}"
        else:
            assert got[name] is not None and want in got[name], f"{name}: {got[name]}"

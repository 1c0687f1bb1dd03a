"""ppcompile.torch_internals: every entry works on the installed torch, a missing API fails loudly, and no
other module of the package reaches torch's private APIs."""

from __future__ import annotations

import ast
import pathlib
import re
from typing import Any

import pytest
import sympy
import torch
from torch.utils._sympy.symbol import SymT, make_symbol

import ppcompile
from ppcompile import torch_internals as ti


@torch.library.custom_op("pptest_internals::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


# ----------------------------------------------------------------------------- every entry, once
def test_bound_entries() -> None:
    assert isinstance(torch.ops.aten.add.Tensor, ti.OpOverload)
    assert isinstance(torch.ops.aten.add, ti.OpOverloadPacket)
    assert ti.tree_leaves(((1, [2]), {"a": 3})) == [1, 2, 3]
    assert ti.qualified_op_name(torch.ops.aten.add.Tensor) == ti.qualified_op_name(torch.ops.aten.add) == \
        "aten::add"
    assert ti.qualified_op_name(torch.ops.pptest_internals.twice.default) == "pptest_internals::twice"
    assert ti.qualified_op_name(torch.add) is None
    assert ti.C_SCALED_DOT_PRODUCT_ATTENTION is torch.nn.functional.scaled_dot_product_attention
    assert ti.has_internal_overlap(torch.ones(1, 3).expand(4, 3))
    assert not ti.has_internal_overlap(torch.ones(4, 3))
    s = sympy.Symbol("s0", integer=True, positive=True)
    assert ti.sympy_interp_python({s: 3}, 2 * s + 1) == 7
    assert ti.sympy_interp_python({s: 3}, sympy.Max(s, 5)) == 5
    assert ti.sympy_interp_logger_name().startswith("torch.")
    ti.shape_check(2 + 2 == 4, lambda: "never")
    with pytest.raises(RuntimeError, match="rows differ"):
        ti.shape_check(False, lambda: "rows differ")


def test_tensor_entries() -> None:
    t = torch.arange(4.0)
    owner = t.untyped_storage()
    storage = ti.storage_from_data_pointer(owner.data_ptr(), t.device, owner.nbytes())
    view = torch.empty(0).set_(storage, 0, (4,), (1,))
    assert torch.equal(view, t)
    x = torch.ones(3, 2)
    ti.mark_dynamic(x, 0)
    assert 0 in x._dynamo_dynamic_indices  # type: ignore[attr-defined]


def test_outside_a_compile() -> None:
    assert ti.compile_id() is None
    assert ti.current_shape_env() is None
    assert ti.dynamo_compile_start_ns() is None
    assert ti.shape_env_facts(None) == (0, 0, 0)


def test_inside_a_compile(fresh_dynamo: None) -> None:
    seen: dict[str, Any] = {}

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        values = [p.meta["example_value"] for p in gm.graph.find_nodes(op="placeholder")]
        size = next(v for v in values if isinstance(v, torch.SymInt))
        env = ti.symint_shape_env(size)
        seen.update(compile_id=ti.compile_id(), env=env, current=ti.current_shape_env(),
                    start=ti.dynamo_compile_start_ns(), guards=ti.shape_env_guards(env),
                    facts=ti.shape_env_facts(env), hints=dict(ti.shape_env_hints(env)))
        return gm.forward

    x = torch.ones(6, 2)
    ti.mark_dynamic(x, 0)
    torch.compile(lambda t: t * 2, backend=backend, fullgraph=True)(x)
    assert seen["compile_id"] is not None and seen["current"] is seen["env"]
    assert ti.frame_compile_index(seen["compile_id"]) == 0 and ti.frame_compile_index(None) is None
    assert seen["start"] is not None and seen["start"] > 0
    assert isinstance(seen["guards"], tuple)
    assert len(seen["facts"]) == 3 and all(isinstance(n, int) for n in seen["facts"])
    assert 6 in seen["hints"].values()


def test_symbol_and_op_entries() -> None:
    assert ti.is_float_symbol(make_symbol(SymT.FLOAT, 0))
    assert not ti.is_float_symbol(make_symbol(SymT.SIZE, 0))
    assert ti.custom_op_module("pptest_internals::twice") == __name__
    assert ti.custom_op_module("aten::add") is None
    assert ti.custom_op_implementation("pptest_internals::twice") is not None
    assert ti.custom_op_implementation("aten::add") is None
    host_read, data_shape = ti.data_dependent_errors()
    with ti.static_fake_mode():
        with pytest.raises(host_read):
            torch.ones(2).tolist()
        with pytest.raises(data_shape):
            torch.ones(2).nonzero()
    assert ti.written_arguments(torch.ops.aten.add_.Tensor) == ((0, "self"),)
    assert ti.written_arguments(torch.ops.aten.add.out) == ((3, "out"),)
    assert ti.written_arguments(torch.ops.aten.add.Tensor) == ()


def test_dynamo_entries() -> None:
    ti.register_backend(ppcompile.pp_breakable, ppcompile.BACKEND_NAME)  # known already: nothing happens
    ti.register_backend(lambda gm, inputs: gm.forward, "pptest_internals_backend")
    assert "pptest_internals_backend" in torch._dynamo.list_backends(exclude_tags=())
    generation = ti.dynamo_generation()
    assert ti.dynamo_generation() == generation  # no reset in between
    ti.reset_dynamo()
    assert ti.dynamo_generation() == generation + 1
    limit = torch._dynamo.config.recompile_limit
    assert ti.recompile_limit() == limit
    ti.raise_recompile_limit(1)  # already higher: unchanged
    assert torch._dynamo.config.recompile_limit == limit
    assert issubclass(ti.restart_analysis(), Exception)
    assert not ti.floats_specialized(["pptest_internals_never_seen"])
    with pytest.raises(ti.restart_analysis()):
        ti.restart_with_floats_specialized(["pptest_internals_float"])
    assert ti.floats_specialized(["pptest_internals_float"])

    def f(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    assert ti.without_dynamo_disable(torch._dynamo.disable(f)) is f
    assert ti.without_dynamo_disable(f) is f


def test_inductor_entries() -> None:
    settings = ti.inductor_config_copy()
    assert "cpp_wrapper" in settings
    gm = torch.fx.symbolic_trace(lambda x: (x.view(-1),))
    fn = ti.inductor_compile(gm, [torch.ones(2, 2)], {})
    assert torch.equal(fn(torch.ones(2, 2))[0], torch.ones(4))
    fake_mode = ti.static_fake_mode()
    with fake_mode:
        fake = torch.empty(2, 3)
    assert type(fake).__name__ == "FakeTensor"
    with ti.tracing_context(fake_mode):
        assert ti.current_shape_env() is fake_mode.shape_env


def test_trace_artifact() -> None:
    ti.trace_artifact(lambda: {"name": "pptest", "encoding": "string"}, lambda: "payload")


# ----------------------------------------------------------------------------- a missing API is loud
class _RenamedShapeEnv:
    guards: list[Any] = []
    replacements: dict[Any, Any] = {}
    # ``divisible`` renamed away by a hypothetical torch release


def test_missing_attribute_names_torch_version_and_attribute() -> None:
    with pytest.raises(ti.TorchInternalsError) as info:
        ti.shape_env_facts(_RenamedShapeEnv())
    assert torch.__version__ in str(info.value) and "ShapeEnv.divisible" in str(info.value)


def test_missing_module_attribute_is_loud(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._library.custom_ops as custom_ops

    monkeypatch.delattr(custom_ops, "OPDEFS")
    with pytest.raises(ti.TorchInternalsError, match=re.escape(torch.__version__)) as info:
        ti.custom_op_module("pptest_internals::twice")
    assert "torch._library.custom_ops.OPDEFS" in str(info.value)


# ----------------------------------------------------------------------------- one door only
_PRIVATE = re.compile(r"^torch\.(_(?!_)|utils\._|fx\.experimental(\.|$))")
_PACKAGE = pathlib.Path(ppcompile.__file__).parent


def _dotted(node: ast.expr) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _private_uses(tree: ast.AST) -> list[str]:
    torch_names = {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            torch_names |= {a.asname for a in node.names if a.name == "torch" and a.asname}
    uses = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted is not None and dotted.split(".")[0] in torch_names:
                names = ["torch." + dotted.partition(".")[2]]
        uses += [f"line {node.lineno}: {n}" for n in names if _PRIVATE.match(n)]  # type: ignore[attr-defined]
    return uses


def test_private_torch_apis_only_in_torch_internals() -> None:
    offenders = {}
    for path in sorted(_PACKAGE.rglob("*.py")):
        if path.parent == _PACKAGE / "torch_internals":
            continue
        uses = _private_uses(ast.parse(path.read_text(), str(path)))
        if uses:
            offenders[str(path.relative_to(_PACKAGE.parent))] = sorted(set(uses))
    assert not offenders, f"private torch APIs outside ppcompile/torch_internals/: {offenders}"


def test_the_checker_sees_each_form() -> None:
    source = ("import torch\nimport torch as T\nimport torch._dynamo\nfrom torch.utils._pytree import x\n"
              "from torch.fx.experimental import symbolic_shapes\nT._C._nn.linear\ntorch.ops.aten.add\n")
    uses = _private_uses(ast.parse(source))
    assert len([u for u in uses if "torch._dynamo" in u]) == 1
    assert any("torch.utils._pytree" in u for u in uses)
    assert any("torch.fx.experimental" in u for u in uses)
    assert any("torch._C._nn.linear" in u for u in uses)
    assert not any("torch.ops" in u for u in uses)

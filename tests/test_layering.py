"""The package's imports point one way: the analysis helpers import nothing of the passes or what follows
them, the trace aids and the observer hooks sit below the passes, the runtime never imports the compile side
or the debug tools, the debug tools observe from above without importing the compile side, the
command-line interface sits above everything and nothing imports it, nothing below it reaches the package's
``__init__``, and no module imports itself back through others (lazy imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ppcompile"
# The analysis helpers (op matching, token locality) sit between the config and the passes: the passes use
# them, they use nothing that comes after.
NOT_FROM_ANALYSIS = ("ppcompile.passes", "ppcompile.backends", "ppcompile.lowering", "ppcompile.runtime",
                     "ppcompile.debug", "ppcompile.models", "ppcompile.pipeline")
# The runtime serves calls; what compiles a stage (analysis, passes, backends, lowering) and what observes
# it (debug) must not be reachable from it.
NOT_FROM_RUNTIME = ("ppcompile.analysis", "ppcompile.passes", "ppcompile.backends", "ppcompile.lowering",
                    "ppcompile.debug")
# The trace aids (marks, declared regions, layers traced once) run before and inside Dynamo's trace; the
# passes read what they leave. They know nothing of what compiles or serves a stage.
NOT_FROM_TRACING = ("ppcompile.passes", "ppcompile.backends", "ppcompile.lowering", "ppcompile.runtime",
                    "ppcompile.debug", "ppcompile.models", "ppcompile.pipeline", "ppcompile.planning")
# What the compile side calls to be observed (dumps, progress, hooks) is low: it imports nothing it observes.
NOT_FROM_OBSERVE = ("ppcompile.analysis", "ppcompile.passes", "ppcompile.backends", "ppcompile.lowering",
                    "ppcompile.runtime", "ppcompile.debug", "ppcompile.models", "ppcompile.pipeline",
                    "ppcompile.tracing", "ppcompile.planning")
# The debug tools (report, HTML, tables) read a built runtime; they hear about it through observe/hooks.py.
NOT_FROM_DEBUG = ("ppcompile.passes", "ppcompile.backends")
# The runtime records traffic (planning.traffic); planning the buckets is the compile side's.
PLANNER = "ppcompile.planning.planner"
# The top level keeps what everything imports and the declarations engines make (engine_ops, capturable);
# an idea of its own gets a wing (a subpackage).
TOP_LEVEL = {"__init__", "__main__", "capturable", "config", "counters", "engine_ops", "envs", "errors",
             "proxy", "records", "symbolic"}
# The commands (ppcompile.cli) drive everything else; only the ``python -m ppcompile`` entry may import them.
CLI = "ppcompile.cli"
CLI_ENTRY = "ppcompile.__main__"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Module -> the ppcompile modules it imports (``from a import b`` counts ``a.b`` when it is one)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("ppcompile"))
            elif isinstance(node, ast.ImportFrom) and not node.level:
                base = node.module or ""
                if not base.startswith("ppcompile"):
                    continue
                for alias in node.names:
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base)
            elif isinstance(node, ast.ImportFrom) and node.level:
                package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
                for _ in range(node.level - 1):
                    package = package.rsplit(".", 1)[0]
                base = f"{package}.{node.module}" if node.module else package
                found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names)
        graph[name] = {m for m in found if m in paths and m != name}
    return graph


def _wrong(layer: str, forbidden: tuple[str, ...]) -> set[tuple[str, str]]:
    return {(m, dep) for m, deps in _imports().items() if m.startswith(layer)
            for dep in deps if dep.startswith(forbidden)}


def test_the_analysis_helpers_import_nothing_downstream() -> None:
    assert not (wrong := _wrong("ppcompile.analysis", NOT_FROM_ANALYSIS)), sorted(wrong)


def test_the_runtime_imports_neither_the_compile_side_nor_debug() -> None:
    assert not (wrong := _wrong("ppcompile.runtime", NOT_FROM_RUNTIME)), sorted(wrong)


def test_the_trace_aids_import_nothing_of_what_compiles_or_serves() -> None:
    assert not (wrong := _wrong("ppcompile.tracing", NOT_FROM_TRACING)), sorted(wrong)


def test_the_observer_hooks_import_nothing_they_observe() -> None:
    assert not (wrong := _wrong("ppcompile.observe", NOT_FROM_OBSERVE)), sorted(wrong)


def test_the_debug_tools_observe_from_above() -> None:
    assert not (wrong := _wrong("ppcompile.debug", NOT_FROM_DEBUG)), sorted(wrong)


def test_the_runtime_does_not_plan() -> None:
    assert not (wrong := _wrong("ppcompile.runtime", (PLANNER,))), sorted(wrong)


def test_the_top_level_keeps_only_what_everything_imports() -> None:
    found = {p.stem for p in PACKAGE.glob("*.py")}
    assert found == TOP_LEVEL, f"new: {sorted(found - TOP_LEVEL)}; gone: {sorted(TOP_LEVEL - found)}"


def test_nothing_below_the_cli_reaches_the_package_init() -> None:
    wrong = {m for m, deps in _imports().items()
             if "ppcompile" in deps and m not in ("ppcompile", CLI_ENTRY) and not _in_cli(m)}
    assert not wrong, sorted(wrong)


def test_nothing_below_the_cli_imports_it() -> None:
    wrong = {(m, dep) for m, deps in _imports().items()
             if m != CLI_ENTRY and not _in_cli(m) for dep in deps if _in_cli(dep)}
    assert not wrong, sorted(wrong)


def _in_cli(module: str) -> bool:
    return module == CLI or module.startswith(CLI + ".")


def test_no_import_cycles() -> None:
    graph = _imports()
    # The package's own __init__ re-exports the public API from everywhere; modules import submodules.
    graph = {m: {d for d in deps if d != "ppcompile"} for m, deps in graph.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep):], dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)

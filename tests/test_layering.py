"""The package's imports point one way: the analysis helpers import nothing of the passes or what follows
them, the runtime never imports the compile side or the debug tools, the command-line interface sits above
everything and nothing imports it, and no module imports itself back through others (lazy imports inside
functions count too)."""

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

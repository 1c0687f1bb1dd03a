"""Docs that are generated from code must be current."""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_pass_reference_is_current() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_pass_docs.py"), "--check"])
    assert result.returncode == 0, "docs/passes.md is stale: run scripts/gen_pass_docs.py"


def test_readme_quick_start_matches_ci() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = "bash scripts/setup.sh && bash scripts/check.sh"
    assert test_command in readme and test_command in ci


# ------------------------------------------------------------------------------ facts quoted in the docs
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]


def test_pass_dump_names_in_the_debugging_guide_match_the_pass_order() -> None:
    """``NN.<pass>.py`` (and its ``TORCH_TRACE`` artifact ``ppcompile_NN_<pass>``): NN is the pass's place
    in ``passes/manager.PASSES`` (00 is Dynamo's graph), so renumbering the passes must update the guide."""
    from ppcompile.passes.manager import PASSES

    names = ["dynamo_graph", *(p.__name__ for p in PASSES)]
    text = (ROOT / "docs" / "debugging.md").read_text()
    quoted = re.findall(r"(?<![\w/])(\d\d)\.([a-z_]+)\.py", text)
    quoted += re.findall(r"ppcompile_(\d\d)_([a-z][a-z_]*[a-z])", text)
    assert len(quoted) >= 4, quoted  # the layout block and the TORCH_TRACE example quote some
    wrong = [f"{index}.{name}" for index, name in quoted
             if int(index) >= len(names) or names[int(index)] != name]
    right = {name: f"{names.index(name):02d}" for _, name in quoted if name in names}
    assert not wrong, f"docs/debugging.md names pass dumps that are written elsewhere: {wrong}; see {right}"


_DEFAULT_PHRASE = re.compile(r"`(\w+)`([^`.;|]{0,80}?)\(?\bdefaults?(?: to| is)? `?([\w.\-]+)")


def _config_defaults() -> dict[str, object]:
    """Each option's declared default (``owned_outputs=None`` stays None: the docs quote the option's
    default, then say what None resolves to)."""
    from ppcompile.config import PPBreakableConfig

    return {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(PPBreakableConfig)}


def _same(quoted: str, value: object) -> bool:
    """A default as the docs quote it (a Python literal, or a bare word) against the config's value."""
    try:
        parsed = ast.literal_eval(quoted)
    except (ValueError, SyntaxError):
        return quoted == str(value)
    if isinstance(value, tuple) and isinstance(parsed, (list, tuple)):
        return tuple(parsed) == value
    return bool(parsed == value) and type(parsed) is type(value)


def test_option_defaults_quoted_in_the_docs_are_the_configs() -> None:
    """"`option` ... (default N" / "`option` defaults to N" in any doc, and the table of
    docs/configuration.md, say what ``PPBreakableConfig()`` holds."""
    defaults = _config_defaults()
    seen, wrong = [], []
    for path in DOCS:
        text = path.read_text()
        for m in _DEFAULT_PHRASE.finditer(text):
            name, value = m.group(1), m.group(3)
            if name in defaults:
                seen.append(f"{path.name}: {name}")
                if not _same(value, defaults[name]):
                    wrong.append(f"{path.name}: `{name}` default {value}, config {defaults[name]!r}")
    table = (ROOT / "docs" / "configuration.md").read_text()
    for m in re.finditer(r"^\| `(\w+)` \| `([^`]*)` \|", table, re.M):
        if m.group(1) in defaults:
            seen.append(f"configuration.md: {m.group(1)}")
            if not _same(m.group(2), defaults[m.group(1)]):
                wrong.append(f"configuration.md: `{m.group(1)}` default {m.group(2)}, "
                             f"config {defaults[m.group(1)]!r}")
    assert "user-guide.md: fold_graph_ops" in seen and len(seen) > len(defaults), seen
    assert not wrong, wrong

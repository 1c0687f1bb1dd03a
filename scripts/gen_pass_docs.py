"""Writes docs/passes.md from the docstrings of the passes, in the order the manager runs them.

Run: .venv/bin/python scripts/gen_pass_docs.py   (tests/test_docs.py checks the file is current)
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "passes.md"
# The passes of this checkout, not of whichever ppcompile is installed (a second worktree shares the venv).
sys.path.insert(0, str(ROOT))

from ppcompile.analysis.token_locality import RULES  # noqa: E402
from ppcompile.passes.manager import PASSES  # noqa: E402


def _fence_literal_blocks(text: str) -> str:
    """reST literal blocks (a line ending in ``::`` then an indented block) -> fenced code blocks."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.endswith("::"):
            out += [line[:-1].replace("``", "`"), "", "```python"]
            i += 2  # the blank line after "::"
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith("    ")):
                out.append(lines[i][4:])
                i += 1
            while out[-1] == "":
                out.pop()
            out += ["```", ""]
            continue
        out.append(line.replace("``", "`"))
        i += 1
    return "\n".join(out)


def render() -> str:
    parts = [
        "# Pass reference\n",
        "Generated from the pass docstrings by `scripts/gen_pass_docs.py`; do not edit by hand.\n",
        "The passes run in this order (`ppcompile/passes/manager.py`, `PASSES`); each is a function",
        "`(gm, ctx) -> PassResult` in a file of the same name under `ppcompile/passes/`.\n",
    ]
    for i, p in enumerate(PASSES, start=1):
        module = inspect.getmodule(p)
        doc = inspect.cleandoc(module.__doc__ or "") if module else ""
        title, _, body = doc.partition("\n")
        parts.append(f"## {i}. `{p.__name__}`\n")
        summary = title.removeprefix(f"Pass ``{p.__name__}``: ").strip().replace("``", "`")
        parts.append(summary[:1].upper() + summary[1:] + "\n")
        parts.append(_fence_literal_blocks(body.strip()) + "\n")
    parts.append(_rules_table())
    return "\n".join(parts)


def _rules_table() -> str:
    """The ops ``check_padding_safety`` knows, grouped by the rule that judges them."""
    groups: dict[str, list[str]] = {}
    for name, rule in sorted(RULES.items()):
        label = (rule.__doc__ or rule.__qualname__).strip().splitlines()[0].replace("``", "`")
        groups.setdefault(label, []).append(f"`{name}`")
    lines = [
        "## Ops known to `check_padding_safety`\n",
        "Torch functions, `Tensor` methods and `aten` ops, by name. Any other op that touches a token",
        "dim is padding-unsafe until registered (`ppcompile.register_token_local_op` or the",
        "`token_local_ops` option). See [padding-safety.md](padding-safety.md).\n",
        "| rule | ops |",
        "|---|---|",
    ]
    lines += [f"| {label} | {', '.join(names)} |" for label, names in groups.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        sys.exit(0 if OUT.read_text() == text else 1)
    OUT.write_text(text)
    print(f"wrote {OUT}")

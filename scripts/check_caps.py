"""Fails, naming the files, when a module is over its line cap: a package module (``ppcompile/**/*.py``) over
400 lines or a test module (``tests/**/*.py``) over 500. A module that grows past its cap is split by idea.

Run: .venv/bin/python scripts/check_caps.py   (scripts/check.sh runs it; tests/test_module_caps.py too)
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CAPS = {"ppcompile": 400, "tests": 500}  # folder under the repository root -> most lines a module may have


def over_caps(root: Path = ROOT, caps: dict[str, int] = CAPS) -> list[str]:
    """One line per module over its folder's cap (``path: N lines, cap M``), paths relative to ``root``, in
    path order; empty when every module fits."""
    found: list[str] = []
    for folder, cap in caps.items():
        for path in sorted((root / folder).rglob("*.py")):
            with path.open("rb") as f:
                lines = sum(1 for _ in f)
            if lines > cap:
                found.append(f"{path.relative_to(root).as_posix()}: {lines} lines, cap {cap}")
    return found


def main() -> int:
    found = over_caps()
    if found:
        print(f"{len(found)} module(s) over the line cap (split them by idea):", *found, sep="\n  ",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

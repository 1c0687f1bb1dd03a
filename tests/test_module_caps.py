"""Modules stay small enough to read in one sitting: the caps ``scripts/check_caps.py`` checks (package
modules at most 400 lines, test modules at most 500), enforced by the suite too."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_caps.py"


def _check_caps() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_caps", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_module_is_within_its_line_cap() -> None:
    assert not (found := _check_caps().over_caps()), "over the line cap (split by idea):\n" + "\n".join(found)


def test_the_check_names_each_module_over_its_cap(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "sub" / "long.py").write_text("x = 1\n" * 4)
    (tmp_path / "pkg" / "short.py").write_text("x = 1\n" * 3)
    (tmp_path / "pkg" / "notes.txt").write_text("x\n" * 10)
    assert _check_caps().over_caps(tmp_path, {"pkg": 3}) == ["pkg/sub/long.py: 4 lines, cap 3"]

"""Docs that are generated from code must be current."""

from __future__ import annotations

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

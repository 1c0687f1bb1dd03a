"""PPCOMPILE_LOG_LEVEL makes ppcompile's log lines visible without any logging setup by the application."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import logging, torch, ppcompile
# An application (or ppcompile's own CLI) configuring the root logger after the import:
logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
f = torch.compile(lambda x: x * 2, backend="pp_breakable", dynamic=True)
with torch.no_grad():
    f(torch.ones(3))
"""


def _stderr(env: dict[str, str]) -> str:
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    return run.stderr


def test_log_level_env_shows_info_lines() -> None:
    assert "INFO ppcompile" in _stderr({"PPCOMPILE_LOG_LEVEL": "info", "PATH": ""})
    assert "INFO ppcompile" not in _stderr({"PATH": ""})


def test_each_line_shows_once_when_the_root_logger_has_a_handler_too() -> None:
    lines = _stderr({"PPCOMPILE_LOG_LEVEL": "info", "PATH": ""}).splitlines()
    ours = [line for line in lines if "ppcompile" in line]
    assert ours and len(ours) == len(set(ours)), ours

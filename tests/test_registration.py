"""The backend is found by name without importing ppcompile, and importing it too never clashes."""

from __future__ import annotations

import subprocess
import sys

import pytest

COMPILE = """
import torch
f = torch.compile(lambda x: x * 2, backend="pp_breakable", dynamic=True)
with torch.no_grad():
    assert f(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]
"""

CASES = {
    "entry point only": COMPILE + "import sys; assert 'ppcompile' in sys.modules\n",
    "import first": "import ppcompile\n" + COMPILE,
    "import after lookup": COMPILE + "import ppcompile, importlib; importlib.reload(ppcompile)\n" + COMPILE,
    "listed": "import torch._dynamo as d; assert 'pp_breakable' in d.list_backends()\n",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_backend_registration(case: str) -> None:
    run = subprocess.run([sys.executable, "-c", CASES[case]], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "duplicate name" not in run.stderr

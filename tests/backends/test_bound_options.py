"""Options without ``options=``: ``PPCOMPILE_OPTIONS`` (spawned workers too), a backend with options bound,
and one registered by name; all checked as ``options=`` is."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch

import ppcompile
from ppcompile import PPBreakableConfig, backend_with_options, register_backend_with_options

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

# A worker process that compiles a two-segment stage with the plain registered name and no options: the
# emulated graph path (not "auto", live-size on CPU) replays only if PPCOMPILE_OPTIONS reached it.
WORKER = """
import torch, ppcompile
lin = torch.nn.Linear(8, 8)
def stage(x):
    h = lin(x)
    q = h.view(h.shape[0], 1, 2, 4)
    return lin(torch.nn.functional.scaled_dot_product_attention(q, q, q).reshape(h.shape[0], 8))
compiled = torch.compile(stage, backend="pp_breakable")
x = torch.randn(5, 8)
ppcompile.mark_token_dynamic(x)
with torch.no_grad():
    torch.testing.assert_close(compiled(x), stage(x))
print("replays", ppcompile.counters.replays, "mode", ppcompile.stage_runtimes()[-1].graph_mode)
"""


def _worker(env_options: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PPCOMPILE_OPTIONS"}
    if env_options is not None:
        env["PPCOMPILE_OPTIONS"] = env_options
    return subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True, env=env,
                          timeout=180)


def test_a_spawned_worker_reads_its_options_from_the_environment() -> None:
    run = _worker('{"graph_mode": "emulate", "capture_sizes": [8]}')
    assert run.returncode == 0, run.stderr[-2000:]
    assert "replays 1 mode emulate" in run.stdout
    run = _worker(None)  # without it, "auto" serves CPU at the live size: nothing replays
    assert run.returncode == 0, run.stderr[-2000:]
    assert "replays 0 mode none" in run.stdout


def test_a_bad_option_in_the_environment_names_the_variable() -> None:
    run = _worker('{"graph_mode": "emulated"}')
    assert run.returncode != 0 and "option 'graph_mode'" in run.stderr and "PPCOMPILE_OPTIONS" in run.stderr


def test_environment_options_sit_under_the_given_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPCOMPILE_OPTIONS", '{"graph_mode": "emulate", "capture_sizes": [8, 16]}')
    config = PPBreakableConfig.from_options({"capture_sizes": [4]})
    assert config.graph_mode == "emulate" and config.capture_sizes == (4,)
    monkeypatch.setenv("PPCOMPILE_OPTIONS", '{"grpah_mode": "emulate"}')
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['grpah_mode'\] \(from PPCOMPILE_OPTIONS\)"):
        PPBreakableConfig.from_options({})
    for bad in ("graph_mode=emulate", '["emulate"]'):
        monkeypatch.setenv("PPCOMPILE_OPTIONS", bad)
        with pytest.raises(ValueError, match="PPCOMPILE_OPTIONS"):
            PPBreakableConfig.from_options({})


def _stage() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)

    class Stage(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            h = lin(x)
            q = h.view(h.shape[0], 1, 2, 4)
            return lin(torch.nn.functional.scaled_dot_product_attention(q, q, q).reshape(h.shape[0], 8))

    x = torch.randn(5, 8)
    ppcompile.mark_token_dynamic(x)
    return Stage(), x


def test_a_backend_with_options_bound_serves_with_them_and_checks_them_at_once() -> None:
    with pytest.raises(ValueError, match="option 'graph_mode'"):
        backend_with_options({"graph_mode": "emulated"})
    stage, x = _stage()
    bound = backend_with_options({"graph_mode": "emulate", "capture_sizes": [8]})
    compiled = torch.compile(stage, backend=bound)
    with torch.no_grad(), ppcompile.counters.expect(replays=1):
        torch.testing.assert_close(compiled(x), stage(x))


def test_a_named_backend_with_options() -> None:
    options = {"graph_mode": "emulate", "capture_sizes": [8]}
    register_backend_with_options("pp_breakable_test_emulate", options)
    with pytest.raises(ValueError, match="already has a backend"):
        register_backend_with_options("pp_breakable_test_emulate", {})
    with pytest.raises(ValueError, match="new backend name"):
        register_backend_with_options("pp_breakable", {})
    stage, x = _stage()
    compiled = torch.compile(stage, backend="pp_breakable_test_emulate")
    with torch.no_grad(), ppcompile.counters.expect(replays=1):
        torch.testing.assert_close(compiled(x), stage(x))

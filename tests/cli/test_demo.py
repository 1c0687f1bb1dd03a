"""``python -m ppcompile demo``: runs end to end in a subprocess; its stream and token parsing."""

from __future__ import annotations

import argparse
import random
import subprocess
import sys

import pytest
import torch

from ppcompile.cli.demo import _Setup, add_arguments, default_token_stream, parse_tokens, split_tokens
from ppcompile.cli.main import main
from ppcompile.config import PPBreakableConfig
from ppcompile.runtime.buckets import make_bucket_plan

SMALL = ["--config", "tiny", "--pp", "2", "--capture-sizes", "4,8,16", "--tokens", "1,8,9,3+5+7,20"]


def _demo(*extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "ppcompile", "demo", *SMALL, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def test_demo_runs_and_shows_both_paths() -> None:
    proc = _demo()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "graph x2" in out and "eager x2" in out, out
    assert "stage_graph" in out and "OK: 0 of 5" in out, out
    assert "'graph_mode': 'emulate'" in out, out  # the demo's graph path on CPU ("auto" would be live-size)


def test_demo_shows_the_graph_path_on_every_device_unless_told() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--config", "tiny", "--capture-sizes", "4,8"])
    assert _Setup.of(args, torch.device("cpu")).options["graph_mode"] == "emulate"
    assert _Setup.of(args, torch.device("cuda", 0)).options["graph_mode"] == "cuda"
    args = parser.parse_args(["--config", "tiny", "--graph-mode", "none"])
    assert _Setup.of(args, torch.device("cpu")).options["graph_mode"] == "none"


def test_demo_fails_beyond_tolerance() -> None:
    proc = _demo("--atol=-1")  # every difference (>= 0) exceeds a negative tolerance
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "MISMATCH" in proc.stdout


def test_parse_tokens() -> None:
    assert parse_tokens("1, 17,8+9+20") == [1, 17, [8, 9, 20]]
    for bad in ("x", "0", "3+-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_tokens(bad)


def test_default_stream_spans_one_token_to_above_cap() -> None:
    plan = make_bucket_plan(PPBreakableConfig(max_capture_tokens=2048))
    rng = random.Random(0)
    totals = [x if isinstance(x, int) else sum(x) for x in default_token_stream(plan, rng)]
    assert totals[0] == 1 and totals[-3:] == [2047, 2048, 2055]
    assert 16 in totals and 17 in totals
    assert sum(isinstance(x, list) and len(x) > 1 for x in default_token_stream(plan, rng)) >= 3
    lens = split_tokens(100, 4, rng)
    assert len(lens) == 4 and sum(lens) == 100 and min(lens) >= 1


@pytest.mark.parametrize(("option", "fix"), [("--tp", "--distributed --tp 2"),
                                             ("--depth", "add --distributed")])
def test_parallel_options_without_distributed_are_a_usage_error(option: str, fix: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """``demo --tp 2`` alone: exit 2 with argparse's usage and what to add, not a traceback."""
    with pytest.raises(SystemExit) as exited:
        main(["demo", option, "2"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith("usage: python -m ppcompile demo")
    assert f"error: {option} 2 needs --distributed" in err and fix in err and "Traceback" not in err

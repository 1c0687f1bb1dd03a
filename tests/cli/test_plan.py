"""``python -m ppcompile plan``: the planned ladder against the default one, and clear failures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ppcompile.cli.main import COMMANDS, main
from ppcompile.config import PPBreakableConfig
from ppcompile.planning.traffic import TokenHistogram
from ppcompile.runtime.buckets import default_capture_ladder


@pytest.fixture
def traffic(tmp_path: Path) -> Path:
    """Chunked prefill in miniature: most forwards fill a 2048-token chunk, the rest are tails."""
    hist = TokenHistogram()
    for n in [2048] * 90 + list(range(100, 2048, 200)) + [20000]:
        hist.record(n)
    path = tmp_path / "traffic.json"
    hist.save(path)
    return path


def test_plan_prints_both_ladders_and_the_options(traffic: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "plan" in COMMANDS
    assert main(["plan", "--traffic", str(traffic), "--max-buckets", "4"]) == 0
    out = capsys.readouterr().out
    assert "101 forwards, 12 distinct token counts" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("planned ",
                                                                                            "default "))}
    assert rows["planned"][1:3] == ["4", "2048"]
    assert rows["default"][1:3] == [str(len(default_capture_ladder(8192))), "8192"]
    options = json.loads(out.split("torch.compile options: ")[1])
    assert len(options["capture_sizes"]) == 4 and options["capture_sizes"][-1] == 2048
    PPBreakableConfig.from_options(options)


def test_plan_json_and_options(traffic: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--traffic", str(traffic), "--max-buckets", "3", "--cap", "1024",
            "--max-padding-factor", "3", "--graph-gain-tokens", "0", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["planned"]["capture_sizes"] == [] and result["planned"]["options"] == {"graph_mode": "none"}
    assert result["default"]["capture_sizes"] == list(default_capture_ladder(1024))
    assert result["default"]["cost"] > 0  # without a gain every padded token is a loss


@pytest.mark.parametrize(("content", "problem"), [
    (None, "cannot read --traffic"),
    ("{oops", "not valid JSON"),
    ('{"format": "ppcompile.token_histogram", "version": 9}', "'version' is 9"),
])
def test_missing_or_malformed_traffic_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              content: str | None, problem: str) -> None:
    path = tmp_path / "traffic.json"
    if content is not None:
        path.write_text(content)
    assert main(["plan", "--traffic", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ppcompile plan: ") and problem in err and str(path) in err


def test_bad_option_exits_2(traffic: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--traffic", str(traffic), "--max-padding-factor", "0.5"]) == 2
    assert "max_padding_factor must be a finite number >= 1.0" in capsys.readouterr().err


def test_probe_measures_a_gain_and_plans_with_it(traffic: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """On CPU the emulation saves nothing, so the probed gain is small; the plan uses it."""
    from ppcompile.cli.gain_probe import probe_graph_gain

    probe = probe_graph_gain([4, 8], calls=2)
    assert probe.sizes == (4, 8) and len(probe.gain_tokens) == 2 and probe.graph_mode == "emulate"
    assert probe.seconds_per_token > 0 and all(t > 0 for t in (*probe.eager_s, *probe.graph_s))
    code = main(["plan", "--probe", "--probe-sizes", "4,8", "--traffic", str(traffic), "--max-buckets", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "graph_gain_tokens = " in out and "no real graphs here" in out
    assert "cost model: padding minus" in out and "padding minus 3900 tokens" not in out  # not the default


def test_plan_needs_traffic_or_a_probe(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan"]) == 2
    assert "--traffic" in capsys.readouterr().err
    assert main(["plan", "--probe", "--probe-sizes", "8"]) == 2
    assert "two or more sizes" in capsys.readouterr().err


def test_malformed_probe_sizes_are_an_argument_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", "--probe", "--probe-sizes", "4,x"])
    assert info.value.code == 2 and "comma-separated ints, got '4,x'" in capsys.readouterr().err

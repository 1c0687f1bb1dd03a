"""``python -m ppcompile dump``, and ``report`` on the folder it wrote."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ppcompile.cli.dump import default_tokens, parse_stage, runnable_summary
from ppcompile.cli.main import main
from ppcompile.observe.runnable import NOT_RUNNABLE, not_runnable_reason


def test_dump_then_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "dumps"
    code = main(["dump", "--stage", "1/4", "--model", "tiny", "--out", str(out), "--capture-sizes", "8,16,32",
                 "--tokens", "12", "--graph-mode", "emulate"])
    printed = capsys.readouterr().out
    assert code == 0
    assert "tiny stage 1/4, 12 tokens in 1 sequence(s)" in printed and "path graph, bucket 16" in printed
    (folder,) = [p for p in out.iterdir() if p.is_dir()]
    assert {"00.dynamo_graph.py", "split_module.py", "report.json", "report.html"} <= {
        p.name for p in folder.iterdir()}
    report = json.loads((folder / "report.json").read_text())
    assert report["captures"]["count"] == 2 * 3 and report["config"]["capture_sizes"] == [8, 16, 32]
    assert report["graph_mode"] == "emulate"

    assert main(["report", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].startswith(f"== {folder.name}")
    assert "captures: 6 graphs" in table
    rows = {line.split()[1]: line for line in table.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"])}
    assert "attention: ppcompile.attention (global layer 1)" in rows["submod_1"]
    bucket_rows = [line.split()[:3] for line in table.splitlines()
                   if line.strip().startswith(("8 ", "16 ", "32 "))]
    assert bucket_rows == [["8", "4-8", "100%"], ["16", "9-16", "78%"], ["32", "17-32", "88%"]]

    assert main(["report", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["stage_graph"] == folder.name


def test_without_tokens_the_forward_fits_the_capture_sizes(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """``--capture-sizes 8,16`` without ``--tokens``: the forward is 15 tokens (not 100, above the cap),
    so it takes the graph path and captures."""
    code = main(["dump", "--stage", "0/2", "--model", "tiny", "--out", str(tmp_path),
                 "--capture-sizes", "8,16", "--graph-mode", "emulate"])
    printed = capsys.readouterr().out
    assert code == 0 and "15 tokens" in printed and "path graph, bucket 16" in printed


@pytest.mark.parametrize(("sizes", "cap", "tokens"), [
    (None, None, 100), ([16, 32, 64], None, 63), ([1], None, 2), (None, 48, 47), ([128, 256], 48, 100)])
def test_default_tokens(sizes: list[int] | None, cap: int | None, tokens: int) -> None:
    assert default_tokens(sizes, cap) == tokens


def test_dump_refuses_one_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dump", "--stage", "0/2", "--model", "tiny", "--out", str(tmp_path), "--tokens", "1"]) == 2
    assert "--tokens must be >= 2" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["4/4", "-1/4", "1", "a/b", "0/0"])
def test_bad_stage_is_rejected(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="--stage"):
        parse_stage(text)


def test_parse_stage() -> None:
    assert parse_stage("1/4") == (1, 4) and parse_stage("0/1") == (0, 1)


def test_every_dumped_file_keeps_the_summarys_promise(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """``python FILE`` for every .py the dump wrote exits 0: it runs the graph (printing each output's
    shape; the reference attention in a made-up forward context), or it says why not as its header does.
    The command's last lines say which files run as is."""
    out = tmp_path / "dumps"
    assert main(["dump", "--stage", "1/4", "--model", "tiny", "--out", str(out), "--capture-sizes", "8,16,32",
                 "--tokens", "12", "--graph-mode", "emulate"]) == 0
    printed = capsys.readouterr().out
    files = sorted(out.rglob("*.py"))
    names = {p.name for p in files}
    assert {"00.dynamo_graph.py", "split_module.py", "01.submod_1.break.py"} <= names, names
    procs = {p: subprocess.Popen([sys.executable, str(p)], cwd=tmp_path, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for p in files}
    not_runnable = []
    for path, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0 and "Traceback" not in stderr, f"{path.name}:\n{stderr}"
        why = not_runnable_reason(path.read_text())
        if why is None:
            assert stdout.splitlines()[0].startswith("0 ("), f"{path.name}: {stdout!r}"  # "0 (12, 64) ..."
        else:
            assert stdout == f"not run: {why}\n"
            not_runnable.append(path.name)
    assert not not_runnable  # the reference models' files all run
    assert f"all {len(files)} .py files run as is" in printed


def test_summary_names_the_files_that_do_not_run(tmp_path: Path) -> None:
    (tmp_path / "segments").mkdir()
    (tmp_path / "split_module.py").write_text("# ppcompile: x\n# Run: python THIS_FILE\n")
    (tmp_path / "segments" / "01.submod_1.break.py").write_text(
        f"# ppcompile: y\n{NOT_RUNNABLE}vllm::unified_attention reads vLLM's forward context\n")
    summary = runnable_summary(str(tmp_path))
    assert summary.splitlines() == [
        "1 of 2 .py files run as is; the others print why and exit 0:",
        f"  {Path('segments', '01.submod_1.break.py')}: vllm::unified_attention reads vLLM's forward context"]

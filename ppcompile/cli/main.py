"""``python -m ppcompile <command>``: the command-line interface.

Each command lives in its own module of ``ppcompile.cli`` with ``add_arguments(parser)`` and
``run(args) -> int``, and optionally ``check_args(args) -> str | None`` (a problem with the combination
of options, reported as a usage error: exit 2); the table below lists them. ``ppcompile/__main__.py``
calls :func:`main`. A reader that closes stdout early (``python -m ppcompile report --json DIR | head``)
ends the command quietly, as ``head``'s other writers do.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("ppcompile.cli.demo", "PP pipeline of a reference model: eager vs pp_breakable, side by side"),
    "dump": ("ppcompile.cli.dump", "compile one reference stage and write its dumps and report"),
    "report": ("ppcompile.cli.report", "print the stage reports under a dump folder as tables"),
    "bench": ("ppcompile.cli.bench", "prefill benchmarks (throughput, wall vs busy, overhead); --write-docs"),
    "plan": ("ppcompile.cli.plan", "a bucket ladder planned from recorded traffic (a token histogram)"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Parses ``argv`` and runs the chosen command; returns its exit code (0 when stdout's reader left)."""
    try:
        code = _run(argv)
        sys.stdout.flush()
    except BrokenPipeError:
        _drop_stdout()
        return 0
    return code


def _run(argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ppcompile", description="ppcompile tools")
    sub = parser.add_subparsers(dest="command", required=True)
    commands: dict[str, argparse.ArgumentParser] = {}
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=help_text, description=module.__doc__)
        module.add_arguments(command)
        command.set_defaults(run=module.run, check_args=getattr(module, "check_args", None))
        commands[name] = command
    args = parser.parse_args(argv)
    if args.check_args is not None and (problem := args.check_args(args)):
        commands[args.command].error(problem)  # usage, the problem, exit 2
    return int(args.run(args))


def _drop_stdout() -> None:
    """Points stdout at /dev/null, so the interpreter's flush at exit does not raise again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's capture): nothing is flushed at exit
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)

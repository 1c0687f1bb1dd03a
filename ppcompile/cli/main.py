"""``python -m ppcompile <command>``: the command-line interface.

Each command lives in its own module of ``ppcompile.cli`` with ``add_arguments(parser)`` and
``run(args) -> int``; the table below lists them. ``ppcompile/__main__.py`` calls :func:`main`.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("ppcompile.cli.demo", "PP pipeline of a reference model: eager vs pp_breakable, side by side"),
    "dump": ("ppcompile.cli.dump", "compile one reference stage and write its dumps and report"),
    "report": ("ppcompile.cli.report", "print the stage reports under a dump folder as tables"),
    "bench": ("ppcompile.cli.bench", "prefill benchmarks (throughput, wall vs busy, overhead) -> docs"),
    "plan": ("ppcompile.cli.plan", "a bucket ladder planned from recorded traffic (a token histogram)"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Parses ``argv`` and runs the chosen command; returns its exit code."""
    parser = argparse.ArgumentParser(prog="python -m ppcompile", description="ppcompile tools")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=help_text, description=module.__doc__)
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    args = parser.parse_args(argv)
    return int(args.run(args))

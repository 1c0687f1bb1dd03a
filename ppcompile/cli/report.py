"""``python -m ppcompile report DIR``: print the stage reports under DIR as tables.

DIR is a dump folder (every ``report.json`` under it, one per stage graph and rank) or one
``report.json``. Reports are written by ``options={"dump_dir": DIR}``, ``PPCOMPILE_DUMP_DIR=DIR`` or
``python -m ppcompile dump``.
"""

from __future__ import annotations

import argparse
import json
import sys

from ppcompile.debug.report import load_reports
from ppcompile.debug.table import format_report

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The report command's options."""
    parser.add_argument("path", help="a dump folder or a report.json")
    parser.add_argument("--json", action="store_true", help="print the reports as JSON instead of tables")


def run(args: argparse.Namespace) -> int:
    """Prints every report found; exits 2 when there is none."""
    try:
        reports = load_reports(args.path)
    except (FileNotFoundError, ValueError) as e:
        print(f"ppcompile report: {e}", file=sys.stderr)
        return 2
    if not reports:
        print(f"ppcompile report: no report.json under {args.path!r}; write one with "
              "options={'dump_dir': ...}, PPCOMPILE_DUMP_DIR or `python -m ppcompile dump`", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([r for _, r in reports], indent=1))
        return 0
    print("\n\n".join(format_report(r, path) for path, r in reports))  # a closed stdout: cli/main.py
    return 0

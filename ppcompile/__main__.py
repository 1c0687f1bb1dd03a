"""``python -m ppcompile <command>``: the command-line interface (``demo``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Parses ``argv`` and runs the chosen subcommand; returns its exit code."""
    from ppcompile import demo

    parser = argparse.ArgumentParser(prog="python -m ppcompile", description="ppcompile tools")
    sub = parser.add_subparsers(dest="command", required=True)
    demo_parser = sub.add_parser(
        "demo", help="PP pipeline of a reference model, eager vs pp_breakable, token counts 1..above cap",
        description=demo.__doc__,
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=demo.run_demo)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    raise SystemExit(main())

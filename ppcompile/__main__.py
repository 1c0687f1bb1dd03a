"""``python -m ppcompile <command>``: runs the command-line interface, :func:`ppcompile.cli.main.main`."""

from __future__ import annotations

from ppcompile.cli.main import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())

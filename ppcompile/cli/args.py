"""Argument types the ``python -m ppcompile`` commands share."""

from __future__ import annotations

import argparse

__all__ = ["int_list"]


def int_list(text: str) -> list[int]:
    """``"16,32,64"`` -> ``[16, 32, 64]`` (empty entries skipped); anything else is an argparse error."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None

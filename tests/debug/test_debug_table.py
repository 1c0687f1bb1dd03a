"""``ppcompile.debug.table``: the terminal tables of the stage report."""

from __future__ import annotations

from ppcompile.debug.table import format_ids, format_table


def test_format_helpers() -> None:
    assert format_ids([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and format_ids([]) == "-"
    text = format_table(["a", "bb", "c"], [[1, "x", ""], [100, "y" * 80, "z" * 80]], right=(0,))
    lines = text.splitlines()
    assert lines[0].split() == ["a", "bb", "c"] and lines[2] == "  1  x"
    assert lines[3] == "100  " + "y" * 53 + "...  " + "z" * 80  # cut to 56 characters, not the last column

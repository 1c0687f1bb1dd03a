"""``ppcompile.debug.table``: the terminal tables of the stage report."""

from __future__ import annotations

from ppcompile.debug.table import _break_kinds, format_ids, format_table
from ppcompile.records import BREAK_KINDS, BreakKind


def test_format_helpers() -> None:
    assert format_ids([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and format_ids([]) == "-"
    text = format_table(["a", "bb", "c"], [[1, "x", ""], [100, "y" * 80, "z" * 80]], right=(0,))
    lines = text.splitlines()
    assert lines[0].split() == ["a", "bb", "c"] and lines[2] == "  1  x"
    assert lines[3] == "100  " + "y" * 53 + "...  " + "z" * 80  # cut to 56 characters, not the last column



def test_the_report_explains_each_kind_of_break_it_holds() -> None:
    """Under the segments table, one line per kind of break present: its ``BREAK_KINDS`` description (a
    kind no ``BreakKind`` has, from a report another version wrote, has none)."""
    kinds = ["attention", "attention", "no such kind", None]
    segments = [{"break_reason": None if k is None else {"kind": k}} for k in kinds]
    assert _break_kinds({"segments": segments}) == [
        "break kinds:", f"  attention: {BREAK_KINDS[BreakKind.ATTENTION].description}"]
    assert _break_kinds({"segments": segments[2:]}) == []

"""``ppcompile.cli.args``: the argument types the commands share."""

from __future__ import annotations

import argparse

import pytest

from ppcompile.cli.args import int_list


def test_int_list() -> None:
    assert int_list("16,32, 64,") == [16, 32, 64]
    assert int_list("") == []
    with pytest.raises(argparse.ArgumentTypeError, match="comma-separated ints, got '16,x'"):
        int_list("16,x")

"""The capturable-break contract's declarations (``ppcompile.capturable``): what they accept and refuse."""

from __future__ import annotations

import pytest
import torch

import ppcompile
from ppcompile.capturable import (
    Metadata,
    Rows,
    capturable_break,
    capturable_breaks,
    declare_capturable,
    forget_capturable,
)


@torch.library.custom_op("pptest::declared_op", mutates_args=())
def declared_op(x: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return x.clone()


META = {"starts": Metadata(Rows.REQUEST_STARTS), "slots": Metadata(Rows.TOKENS, pad=-1)}


def test_a_declaration_is_found_by_name_and_replaced_by_the_next() -> None:
    entry = declare_capturable(torch.ops.pptest.declared_op, META)
    try:
        assert entry.op == "pptest::declared_op" and capturable_break("pptest::declared_op") is entry
        assert entry.requests_for(64) == 64 and entry.refused is None
        capped = declare_capturable("pptest::declared_op", META, max_requests=8)
        assert capturable_breaks()["pptest::declared_op"] is capped and capped.requests_for(64) == 8
        assert capped.requests_for(4) == 4
    finally:
        forget_capturable("pptest::declared_op")
    assert capturable_break("pptest::declared_op") is None


def test_a_host_plan_is_refused_unless_planned_outside() -> None:
    try:
        refused = declare_capturable("pptest::declared_op", META, host_plan="a per-forward plan()")
        assert refused.refused is not None and "plan()" in refused.refused
        planned = declare_capturable("pptest::declared_op", META, host_plan="x", planned_outside=True)
        assert planned.refused is None
    finally:
        forget_capturable("pptest::declared_op")


@pytest.mark.parametrize(("op", "metadata", "kwargs", "message"), [
    (torch.ops.pptest.declared_op, {"lengths": Metadata(Rows.REQUESTS)}, {}, "not arguments of the op"),
    ("declared_op", META, {}, "namespace::name"),
    ("pptest::declared_op", {}, {}, "at least one metadata argument"),
    ("pptest::declared_op", META, {"max_requests": 0}, "max_requests"),
])
def test_bad_declarations_raise(op: object, metadata: dict[str, Metadata], kwargs: dict[str, object],
                                message: str) -> None:
    with pytest.raises(ValueError, match=message):
        declare_capturable(op, metadata, **kwargs)
    assert capturable_break("pptest::declared_op") is None


@pytest.mark.parametrize(("fields", "message"), [
    ({"rows": Rows.REQUEST_STARTS, "pad": 1}, "takes no pad"),
    ({"rows": Rows.TOKENS, "pad": "x"}, "pad"),
    ({"rows": Rows.REQUESTS, "capacity": {0: 4}}, "capacity"),
    ({"rows": Rows.REQUESTS, "capacity": {1: 0}}, "capacity"),
    ({"rows": "columns"}, "columns"),
])
def test_bad_metadata_raises(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Metadata(**fields)  # type: ignore[arg-type]


def test_the_package_exports_the_declaration_api() -> None:
    assert ppcompile.declare_capturable is declare_capturable
    assert ppcompile.Metadata is Metadata and ppcompile.Rows is Rows
    assert Metadata("tokens", pad=-1).rows is Rows.TOKENS

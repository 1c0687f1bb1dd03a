"""``check_capturable`` holds a call of a declared op to its contract: the reference paged attention and
the toy op keep it; ops that write for a padded row, or let padded rows reach live ones, are caught."""

from __future__ import annotations

import pytest
import torch
from whole_stage_toy import CONTRACT, make_meta

import ppcompile
from ppcompile.capturable import declare_capturable
from ppcompile.models import make_paged_metadata
from ppcompile.runtime.contract_check import CapturableContractError, check_capturable


def _paged_call(new: list[int], prefix: list[int]) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    meta = make_paged_metadata(new, prefix, block_size=4, blocks_per_request=6, num_blocks=32, shuffle_seed=1)
    t = sum(new)
    q, k, v = (torch.randn(t, h, 8, generator=gen) for h in (4, 2, 2))
    cache = torch.randn(32 * 4, 2, 2, 8, generator=gen)
    return q, k, v, cache, meta.query_start_loc, meta.seq_lens, meta.block_table, meta.slot_mapping


@pytest.mark.parametrize(("new", "prefix", "bucket", "requests"), [
    ([3, 5], [0, 4], 16, None), ([1, 2, 4], [6, 0, 2], 8, 3), ([7], [9], 7, 1)])
def test_the_reference_paged_attention_keeps_its_contract(new: list[int], prefix: list[int], bucket: int,
                                                          requests: int | None) -> None:
    args = _paged_call(new, prefix)
    cache = args[3].clone()
    check_capturable(torch.ops.ppcompile.paged_attention, *args, 3, 4, bucket=bucket, requests=requests)
    assert torch.equal(args[3], cache)  # the caller's cache is untouched


def test_the_toy_op_keeps_its_contract() -> None:
    starts, slots = make_meta([2, 3], first_slot=5)
    x, cache = torch.randn(5, 4), torch.randn(16, 4)
    ppcompile.check_capturable(torch.ops.pptest.causal_mix, x, cache, starts, slots, bucket=12)


@torch.library.custom_op("pptest::writes_slot_minus_one", mutates_args=("cache",))
def writes_slot_minus_one(x: torch.Tensor, cache: torch.Tensor, starts: torch.Tensor,
                          slots: torch.Tensor) -> torch.Tensor:
    cache.index_put_((slots,), x)  # slot -1 is the last row, in Python's indexing
    return x.clone()


@torch.library.custom_op("pptest::reads_padded_rows", mutates_args=("cache",))
def reads_padded_rows(x: torch.Tensor, cache: torch.Tensor, starts: torch.Tensor,
                      slots: torch.Tensor) -> torch.Tensor:
    return x - x.mean(0)  # every row, padding included


for _op in ("pptest::writes_slot_minus_one", "pptest::reads_padded_rows"):
    declare_capturable(_op, CONTRACT)


@pytest.mark.parametrize(("op", "message"), [
    (torch.ops.pptest.writes_slot_minus_one, "wrote cache"),
    (torch.ops.pptest.reads_padded_rows, "live rows of output 0 differ"),
])
def test_a_broken_promise_is_named(op: object, message: str) -> None:
    starts, slots = make_meta([2, 3], first_slot=0)
    with pytest.raises(CapturableContractError, match=message):
        check_capturable(op, torch.randn(5, 4), torch.zeros(16, 4), starts, slots, bucket=8)


def test_an_undeclared_op_or_a_small_bucket_is_refused() -> None:
    starts, slots = make_meta([2, 3])
    x, cache = torch.randn(5, 4), torch.zeros(16, 4)
    with pytest.raises(ValueError, match="not declared capturable"):
        check_capturable(torch.ops.aten.add, x, x, bucket=8)
    with pytest.raises(ValueError, match="hold fewer"):
        check_capturable(torch.ops.pptest.causal_mix, x, cache, starts, slots, bucket=4)

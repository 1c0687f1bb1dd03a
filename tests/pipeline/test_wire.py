"""The wire format between PP stages: the proxy spec (exchanged once, versioned) and the packed layout
that carries every proxy of a micro-batch in one message, unpacked as views."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppcompile.pipeline import PackedLayout, ProxySpec
from ppcompile.pipeline.wire import ALIGN, WIRE_VERSION, ProxyField

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool]


def _random_tensor(n: int, row: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bits of ``dtype`` (NaNs and infinities included for floats): a byte-level round trip."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * max(1, torch.Size(row).numel()) * dtype.itemsize,), dtype=torch.uint8,
                        generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw[: n * torch.Size(row).numel() * dtype.itemsize].view(dtype).view(n, *row)


FIELDS = st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(1, 5), max_size=2)),
                  min_size=1, max_size=5)


@settings(max_examples=200, deadline=None)
@given(fields=FIELDS, n=st.integers(1, 37), seed=st.integers(0, 2**16))
def test_packing_round_trips_every_dtype_mix_byte_for_byte(fields: list[tuple[torch.dtype, list[int]]],
                                                           n: int, seed: int) -> None:
    proxies = {f"p{i}": _random_tensor(n, tuple(row), dtype, seed + i)
               for i, (dtype, row) in enumerate(fields)}
    spec = ProxySpec.of(proxies, n, rank=0)
    layout = PackedLayout(ProxySpec.decode(spec.encode(torch.device("cpu")).tolist()))  # as the receiver
    buf = torch.full((layout.nbytes(n) + 40,), 0xAB, dtype=torch.uint8)  # larger than needed: a reused slot
    packed = layout.pack(proxies, buf, n)
    assert packed.numel() == layout.nbytes(n) and packed.data_ptr() == buf.data_ptr()
    wire = packed.clone()  # what the receiver gets: only the packed bytes
    got = layout.views(wire, n)
    assert list(got) == list(proxies)
    for name, t in proxies.items():
        g = got[name]
        assert g.dtype == t.dtype and g.shape == t.shape and g.is_contiguous()
        assert g.untyped_storage().data_ptr() == wire.untyped_storage().data_ptr()  # a view, no copy
        assert torch.equal(g.view(torch.uint8), t.view(torch.uint8))  # bit-identical, NaN payloads too
    offsets = layout.offsets(n)
    assert all(at % ALIGN == 0 for at in offsets)
    ends = [at + n * f.row_bytes for at, f in zip(offsets, spec.fields)]
    assert all(end <= nxt for end, nxt in zip(ends, [*offsets[1:], layout.nbytes(n)]))  # no overlap


def test_layout_describes_names_dtypes_offsets() -> None:
    spec = ProxySpec((ProxyField("hidden_states", torch.float32, (64,)),
                      ProxyField("topk", torch.int32, (3,)), ProxyField("mask", torch.bool, ())))
    layout = PackedLayout(spec)
    assert layout.offsets(5) == (0, 1280, 1344)  # 5 x 256 B; 5 x 12 B = 60 -> 64; 5 x 1 B -> 16
    assert layout.nbytes(5) == 1344 + 16
    assert layout.describe(5)[1] == {"name": "topk", "dtype": "int32", "row_shape": [3], "offset": 1280,
                                     "bytes": 60}
    with pytest.raises(ValueError, match="1-d uint8 buffer of at least 1360 bytes"):
        layout.views(torch.empty(100, dtype=torch.uint8), 5)
    with pytest.raises(ValueError, match="1-d uint8 buffer"):
        layout.views(torch.empty(2000, dtype=torch.float32), 5)


def test_proxy_spec_round_trip_and_checks() -> None:
    proxies = {"hidden_states": torch.zeros(5, 8), "topk_indices": torch.zeros(5, 2, dtype=torch.int32),
               "bank": torch.zeros(5, 3, 4, dtype=torch.bfloat16)}
    spec = ProxySpec.of(proxies, 5, rank=0)
    assert spec.fields[1] == ProxyField("topk_indices", torch.int32, (2,))
    words = spec.encode(torch.device("cpu")).tolist()
    assert words[0] == WIRE_VERSION
    assert ProxySpec.decode(words) == spec
    with pytest.raises(ValueError, match=f"wire version 1, this rank speaks {WIRE_VERSION}"):
        ProxySpec.decode([1, *words[1:]])
    with pytest.raises(ValueError, match=r"'hidden_states'.*5 rows.*shape \(4, 8\)"):
        ProxySpec.of({"hidden_states": torch.zeros(4, 8)}, 5, rank=1)
    with pytest.raises(TypeError, match="stage 2 returned Tensor"):
        ProxySpec.of(torch.zeros(5, 8), 5, rank=2)
    with pytest.raises(ValueError, match="no proxy tensors"):
        ProxySpec.of({}, 5, rank=0)
    with pytest.raises(TypeError, match=r"has dtype torch\.complex64"):
        ProxySpec.of({"z": torch.zeros(5, 2, dtype=torch.complex64)}, 5, rank=0)

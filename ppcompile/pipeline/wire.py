"""What one PP stage sends the next: the proxies' spec, exchanged once, and the packed layout that carries
every proxy of a micro-batch in one message.

The spec (:class:`ProxySpec`: names, dtypes, per-token row shapes and a wire version) travels once, with
the first micro-batch. Every later micro-batch of ``n`` tokens is one contiguous byte buffer of
``PackedLayout.nbytes(n)`` bytes holding each proxy's ``[n, *row_shape]`` block in spec order, each block
starting on a 16-byte boundary::

    hidden_states [n, 64] fp32 | residual [n, 64] fp32 | topk_indices [n, 8] int32
    offset 0                     align16(256 n)           + align16(256 n)

so the sender makes one P2P call per micro-batch (whatever the number of proxies and their dtypes) and
the receiver unpacks with views, no copy: each proxy is a contiguous tensor at its block's offset, as
an unpacked tensor would be (the next stage's Dynamo sees eager's strides).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["ALIGN", "WIRE_VERSION", "PackedLayout", "ProxyField", "ProxySpec"]

WIRE_VERSION = 2
"""Bumped whenever the spec's encoding or the packed layout changes (1: one message per proxy)."""
ALIGN = 16
"""Each block of a packed micro-batch starts at a multiple of this many bytes."""
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool)  # wire codes: index in this tuple


@dataclasses.dataclass(frozen=True)
class ProxyField:
    """One proxy on the wire: its name, dtype and the shape of one token's row."""

    name: str
    dtype: torch.dtype
    row_shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        return math.prod(self.row_shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class ProxySpec:
    """What one stage sends the next, per token; the token count comes from the batch."""

    fields: tuple[ProxyField, ...]

    @classmethod
    def of(cls, proxies: Any, num_tokens: int, rank: int) -> ProxySpec:
        """The spec of stage ``rank``'s output; checks that every proxy is token-major."""
        if not isinstance(proxies, Mapping):
            raise TypeError(f"stage {rank} returned {type(proxies).__name__}; a non-last stage must return "
                            "a mapping of proxy tensors (PPProxyTensors or dict) for the next stage")
        fields = []
        for name, t in proxies.items():
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != num_tokens:
                got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"stage {rank}'s proxy {name!r}: expected a token-major tensor with "
                                 f"{num_tokens} rows (sum(seq_lens)), got {got}")
            if t.dtype not in _DTYPES:
                raise TypeError(f"stage {rank}'s proxy {name!r} has dtype {t.dtype}; supported: {_DTYPES}")
            fields.append(ProxyField(str(name), t.dtype, tuple(t.shape[1:])))
        if not fields:
            raise ValueError(f"stage {rank} returned no proxy tensors for the next stage")
        return cls(tuple(fields))

    def encode(self, device: torch.device) -> torch.Tensor:
        """``[version, count, (name_len, *name_bytes, dtype_code, ndim, *row_shape) per field]``, int64."""
        words = [WIRE_VERSION, len(self.fields)]
        for f in self.fields:
            raw = f.name.encode()
            words += [len(raw), *raw, _DTYPES.index(f.dtype), len(f.row_shape), *f.row_shape]
        return torch.tensor(words, dtype=torch.int64, device=device)

    @classmethod
    def decode(cls, words: Sequence[int]) -> ProxySpec:
        """The inverse of :meth:`encode`; refuses another wire version."""
        it = iter(int(w) for w in words)
        version = next(it, None)
        if version != WIRE_VERSION:
            raise ValueError(f"proxy spec of wire version {version}, this rank speaks {WIRE_VERSION}: every "
                             "rank of a pipeline must run the same ppcompile")
        fields = []
        for _ in range(next(it)):
            name = bytes(next(it) for _ in range(next(it))).decode()
            dtype = _DTYPES[next(it)]
            row_shape = tuple(next(it) for _ in range(next(it)))
            fields.append(ProxyField(name, dtype, row_shape))
        return cls(tuple(fields))


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Where each proxy of an ``n``-token micro-batch sits in its packed byte buffer (module docstring)."""

    spec: ProxySpec

    def offsets(self, n: int) -> tuple[int, ...]:
        """Each field's byte offset, in spec order."""
        out, at = [], 0
        for f in self.spec.fields:
            out.append(at)
            at += _aligned(n * f.row_bytes)
        return tuple(out)

    def nbytes(self, n: int) -> int:
        """The packed size of an ``n``-token micro-batch."""
        return sum(_aligned(n * f.row_bytes) for f in self.spec.fields)

    def views(self, buf: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
        """Each proxy of the micro-batch in ``buf`` (uint8, at least :meth:`nbytes` long), as views."""
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < self.nbytes(n):
            raise ValueError(f"a packed {n}-token micro-batch needs a 1-d uint8 buffer of at least "
                             f"{self.nbytes(n)} bytes, got {buf.dtype} {tuple(buf.shape)}")
        return {f.name: buf[at:at + n * f.row_bytes].view(f.dtype).view(n, *f.row_shape)
                for f, at in zip(self.spec.fields, self.offsets(n))}

    def pack(self, proxies: Mapping[str, torch.Tensor], buf: torch.Tensor, n: int) -> torch.Tensor:
        """Copies ``proxies`` (``n`` rows each) into ``buf``; returns the packed bytes (a prefix of it)."""
        for name, view in self.views(buf, n).items():
            view.copy_(proxies[name])
        return buf[:self.nbytes(n)]

    def describe(self, n: int) -> list[dict[str, Any]]:
        """The layout of an ``n``-token micro-batch: name, dtype, row shape, offset and bytes per field."""
        return [{"name": f.name, "dtype": str(f.dtype).removeprefix("torch."), "row_shape": list(f.row_shape),
                 "offset": at, "bytes": n * f.row_bytes}
                for f, at in zip(self.spec.fields, self.offsets(n))]

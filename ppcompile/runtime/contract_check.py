"""``check_capturable``: holds one call of a declared capturable op to its contract, for an engine's tests.

A declaration (``ppcompile.declare_capturable``) is a promise ppcompile cannot read off a compiled kernel:
that padded token rows and padded requests write nothing and change no live row. This check runs the op
twice on a real call, once as given and once padded the way a whole-stage graph pads it (token-major
arguments to ``bucket`` rows of garbage, metadata by its declared rules, requests to ``requests``), and
compares:

* the live rows of every output: padded rows and requests must not reach them;
* every argument the op writes (its KV cache): padded rows and requests must write nothing more.

Example::

    ppcompile.check_capturable(torch.ops.myengine.paged_attention, q, k, v, cache, qsl, lens, table, slots,
                               layer_id, block_size, bucket=64, requests=16)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ppcompile.capturable import Metadata, Rows, capturable_break
from ppcompile.runtime.whole_stage import live_requests, metadata_buffer, pad_metadata
from ppcompile.torch_internals.ops import op_schema, qualified_op_name

__all__ = ["CapturableContractError", "check_capturable"]


class CapturableContractError(AssertionError):
    """A declared capturable op broke its contract on a padded call (the message names the promise)."""


def _live_tokens(values: dict[str, Any], metadata: dict[str, Metadata]) -> int:
    for name, meta in metadata.items():
        if meta.rows is Rows.TOKENS:
            return int(values[name].shape[0])
        if meta.rows is Rows.REQUEST_STARTS:
            return int(values[name][-1])
    raise ValueError("check_capturable: the declaration names no token or request-start metadata, so the "
                     "live token count is unknown")


def _padded(value: torch.Tensor, meta: Metadata, tokens: int, requests: int) -> torch.Tensor:
    buf = metadata_buffer(value, meta, tokens, requests)
    pad_metadata(buf, value, meta)
    return buf


def _garbage_rows(value: torch.Tensor, bucket: int, seed: int) -> torch.Tensor:
    """``value`` with rows up to ``bucket`` appended, of values a padded row may hold in a whole graph."""
    extra = torch.empty((bucket - value.shape[0], *value.shape[1:]), dtype=value.dtype, device=value.device)
    gen = torch.Generator(device=value.device).manual_seed(seed)
    if value.is_floating_point():
        extra.copy_(torch.randn(extra.shape, generator=gen, device=value.device) * 3)
    else:
        extra.copy_(torch.randint(0, 7, extra.shape, generator=gen, device=value.device))
    return torch.cat([value, extra])


def check_capturable(op: Any, *args: Any, bucket: int, requests: int | None = None, atol: float = 1e-5,
                     **kwargs: Any) -> None:
    """Runs ``op`` (declared capturable) on ``args`` and on ``args`` padded to ``bucket`` token rows and
    ``requests`` requests (default: ``bucket``) as a whole-stage graph pads them; raises
    :class:`CapturableContractError` when a live output row or a written argument differs (module
    docstring). Tensors the op writes are cloned for each run: the caller's are left as they were."""
    name = qualified_op_name(op) or str(op)
    entry = capturable_break(name)
    if entry is None:
        raise ValueError(f"check_capturable: {name} is not declared capturable "
                         "(ppcompile.declare_capturable)")
    schema = op_schema(op)
    names = [a.name for a in schema.arguments]
    values = {**dict(zip(names, args)), **kwargs}
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    metadata = dict(entry.metadata)
    n = _live_tokens(values, metadata)
    live = next((r for k, m in metadata.items() if (r := live_requests(m, values[k])) is not None), 0)
    capacity = requests if requests is not None else entry.requests_for(bucket)
    if bucket < n or capacity < live:
        raise ValueError(f"check_capturable: bucket {bucket} / requests {capacity} hold fewer than the "
                         f"call's {n} tokens / {live} requests")
    padded: dict[str, Any] = {}
    for k, (key, value) in enumerate(values.items()):
        if key in metadata:
            padded[key] = _padded(value, metadata[key], bucket, capacity)
        elif key in written or not isinstance(value, torch.Tensor):
            padded[key] = value
        elif value.dim() and value.shape[0] == n:
            padded[key] = _garbage_rows(value, bucket, seed=k)
        else:
            padded[key] = value
    plain = _run(op, values, written)
    wide = _run(op, padded, written)
    _compare(name, plain, wide, n, atol)


def _run(op: Any, values: dict[str, Any], written: set[str]) -> tuple[Sequence[Any], dict[str, torch.Tensor]]:
    call = {k: v.clone() if k in written and isinstance(v, torch.Tensor) else v for k, v in values.items()}
    out = op(**call)
    outputs = out if isinstance(out, (tuple, list)) else () if out is None else (out,)
    return outputs, {k: call[k] for k in written}


def _compare(name: str, plain: tuple[Sequence[Any], dict[str, torch.Tensor]],
             wide: tuple[Sequence[Any], dict[str, torch.Tensor]], n: int, atol: float) -> None:
    for i, (a, b) in enumerate(zip(plain[0], wide[0])):
        if isinstance(a, torch.Tensor) and not torch.allclose(a, b[:n], atol=atol, rtol=0, equal_nan=True):
            raise CapturableContractError(
                f"{name}: live rows of output {i} differ once the call is padded (largest difference "
                f"{(a.float() - b[:n].float()).abs().max():.3g}): padded rows or requests reach live rows")
    for key, a in plain[1].items():
        b = wide[1][key]
        if not torch.allclose(a, b, atol=atol, rtol=0, equal_nan=True):
            rows = (a != b).reshape(a.shape[0], -1).any(1).nonzero().flatten().tolist()
            more = "..." if len(rows) > 8 else ""
            raise CapturableContractError(
                f"{name}: padded rows or requests wrote {key} (rows {rows[:8]}{more} differ from the "
                "unpadded call's): a padded row must write nothing (its slot is the declared pad), a padded "
                "request nothing either")

"""Whole-stage graphs: the stage, its capturable breaks included, as one graph per small bucket.

When every break of a stage is an op declared capturable (``ppcompile.capturable``), a forward of at most
``whole_graph_tokens`` live tokens needs no break at all: its metadata inputs are copied into static
buffers padded by the contract (padded token rows get the declared pad, a KV slot of -1; padded requests
have zero length), its other token inputs into zero-padded buffers, and one graph per bucket replays the
stage's program (``live_forward`` at the bucket's sizes) on them. Outputs are trimmed to the live count
and copied (unless ``owned_outputs=False``); inputs the stage writes in place get their live rows back.

A forward that does not fit (more tokens than the largest whole bucket, more requests than a bucket
holds, a metadata dim over its capacity, a fixed-size input of another shape than the bucket captured)
takes the breakable path: nothing is truncated. A bucket is captured at its first use with that call's
data, or (``capture="all"``) at the first call with no live row and all-padding metadata; a failed capture
turns whole graphs off for that bucket (its forwards run breakable).

Per call with ``n`` tokens at whole bucket ``b`` (``R`` live requests, capacity ``C``)::

    slot_mapping [n]    -> buffer [b]      rows n:b = -1        (Rows.TOKENS, pad -1)
    query_start_loc [R+1] -> buffer [C+1]  tail = live last      (Rows.REQUEST_STARTS)
    seq_lens [R]        -> buffer [C]      tail = 0              (Rows.REQUESTS, pad 0)
    hidden [n, H]       -> buffer [b, H]   rows n:b = 0          (a token input)
    replay graph (whole, b); outputs [b, ...] -> [:n]
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal

import sympy
import torch

from ppcompile.capturable import Metadata, Rows
from ppcompile.counters import counters
from ppcompile.runtime.executors import GraphExecutor
from ppcompile.runtime.static_buffers import TokenDims, copy_in, narrow_to

__all__ = ["WholeGraphs", "WholeInput", "WholeStagePlan"]

log = logging.getLogger(__name__)

Env = dict[sympy.Symbol, int]
InputRole = Literal["token", "metadata", "fixed", "pass", "size"]


@dataclasses.dataclass(frozen=True)
class WholeInput:
    """How one stage input reaches a whole-stage graph: ``token`` (copied into a zero-padded buffer along
    ``dims``), ``metadata`` (padded by ``metadata``'s rule), ``fixed`` (a tensor without token dims,
    copied whole), ``size`` (the bucket's value of ``symbol``) or ``pass`` (module state, a baked number:
    handed over as it is)."""

    slot: int
    name: str
    role: InputRole
    dims: TokenDims = ()
    metadata: Metadata | None = None
    symbol: sympy.Symbol | None = None
    written: bool = False  # the stage writes it in place: live rows are copied back after the replay


@dataclasses.dataclass(frozen=True)
class WholeStagePlan:
    """What lowering decided for whole-stage graphs (``lowering/whole_stage.py``)."""

    max_tokens: int  # whole_graph_tokens: the largest bucket served whole
    max_requests: int | None  # requests per bucket: the bucket's tokens, capped by the declarations
    inputs: tuple[WholeInput, ...]  # every stage input, in order (``inputs[i].slot == i``)
    # Symbols other than the token count, bound per bucket from a static buffer's dim: (symbol, slot, dim).
    bound_symbols: tuple[tuple[sympy.Symbol, int, int], ...]
    # Per stage output: ("tensor", token dims to trim), ("size", its expression) or ("const", the value).
    outputs: tuple[tuple[str, Any], ...]
    ops: tuple[str, ...]  # the capturable ops it holds, for reports

    def requests_for(self, bucket: int) -> int:
        return bucket if self.max_requests is None else min(bucket, self.max_requests)


def metadata_buffer(value: torch.Tensor, meta: Metadata, tokens: int, requests: int) -> torch.Tensor:
    """A buffer for metadata like ``value`` at ``tokens`` rows or ``requests`` requests (by ``meta.rows``)
    and ``meta``'s capacities, all padding: a forward of nothing (request starts all 0)."""
    rows = tokens if meta.rows is Rows.TOKENS else requests + (meta.rows is Rows.REQUEST_STARTS)
    shape = [rows, *value.shape[1:]]
    for d, size in meta.capacity.items():
        shape[d] = size
    return torch.full(shape, meta.pad, dtype=value.dtype, device=value.device)


def live_requests(meta: Metadata, value: torch.Tensor) -> int | None:
    """The live requests metadata ``value`` holds rows for (None for token rows)."""
    if meta.rows is Rows.REQUESTS:
        return int(value.shape[0])
    if meta.rows is Rows.REQUEST_STARTS:
        return int(value.shape[0]) - 1
    return None


def pad_metadata(buf: torch.Tensor, src: torch.Tensor, meta: Metadata) -> None:
    """Copies live metadata ``src`` into the leading corner of ``buf`` and pads the rest by ``meta``'s
    rule: request starts repeat their last live entry, everything else gets ``meta.pad``. No host sync:
    every write is a device copy or fill."""
    corner = buf[tuple(slice(0, s) for s in src.shape)]
    if meta.rows is Rows.REQUEST_STARTS:
        rows = src.shape[0]
        corner.copy_(src)
        if buf.shape[0] > rows:
            tail = buf.narrow(0, rows, buf.shape[0] - rows)
            tail.copy_(src.narrow(0, rows - 1, 1).expand_as(tail))
        return
    if tuple(src.shape[1:]) != tuple(buf.shape[1:]):
        buf.fill_(meta.pad)  # a narrower capacity dim: its tail too
    elif buf.shape[0] > src.shape[0]:
        buf.narrow(0, src.shape[0], buf.shape[0] - src.shape[0]).fill_(meta.pad)
    corner.copy_(src)


@dataclasses.dataclass
class _Bucket:
    """One captured whole-stage bucket: its static arguments, sizes and the graph's outputs."""

    args: tuple[Any, ...]
    env: Env
    requests: int
    fixed_shapes: tuple[tuple[int, ...], ...]  # of the ``fixed`` inputs, as captured
    outputs: tuple[Any, ...] = ()


class _WholeForward:
    """The stage's program at one bucket's sizes, as the executor captures it (a class, not a closure:
    its repr names the bucket in capture errors)."""

    def __init__(self, live_forward: Callable[..., Sequence[Any]], env: Env, tensor_outputs: Sequence[int]):
        self.live_forward = live_forward
        self.env = env
        self.tensor_outputs = tuple(tensor_outputs)

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        outputs = self.live_forward(args, self.env)
        return tuple(outputs[i] for i in self.tensor_outputs)

    def __repr__(self) -> str:
        return f"whole-stage forward at {self.env}"


class WholeGraphs:
    """The whole-stage graphs of one stage instance: one per bucket up to ``plan.max_tokens``, captured
    at first use by ``executor`` (its own: these graphs share nothing with the breakable path's)."""

    def __init__(self, plan: WholeStagePlan, buckets: Sequence[int], live_forward: Callable[..., Any],
                 executor: GraphExecutor, token: sympy.Symbol, stage: str, owned_outputs: bool) -> None:
        self.plan = plan
        self.buckets = tuple(sorted(b for b in buckets if b <= plan.max_tokens))
        self.executor = executor
        self._live_forward = live_forward
        self._token = token
        self._stage = stage
        self._owned = owned_outputs
        self._captured: dict[int, _Bucket] = {}
        self.failed_buckets: dict[int, str] = {}
        self._tensor_outputs = tuple(i for i, (kind, _) in enumerate(plan.outputs) if kind == "tensor")
        self._metadata = tuple(i for i in plan.inputs if i.role == "metadata")

    @property
    def captured_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._captured))

    # ----------------------------------------------------------------------------------- decision
    def bucket_for_tokens(self, n: int) -> int | None:
        """The smallest whole bucket of at least ``n`` tokens, or None."""
        k = bisect.bisect_left(self.buckets, n)
        return self.buckets[k] if k < len(self.buckets) else None

    def bucket_for(self, args: Sequence[Any], n: int) -> int | None:
        """The whole bucket that serves ``n`` live tokens with these metadata, or None (breakable)."""
        b = self.bucket_for_tokens(n)
        if b is None or b in self.failed_buckets or not self._fits(args, n, b):
            return None
        return b

    def _fits(self, args: Sequence[Any], n: int, b: int) -> bool:
        capacity = self.plan.requests_for(b)
        for spec in self._metadata:
            assert spec.metadata is not None
            value = args[spec.slot]
            requests = live_requests(spec.metadata, value)
            if requests is not None and requests > capacity:
                return False
            if spec.metadata.rows is Rows.TOKENS and value.shape[0] != n:
                return False
            for d, size in spec.metadata.capacity.items():
                if d < value.dim() and value.shape[d] > size:
                    return False
        bucket = self._captured.get(b)
        if bucket is not None:
            fixed = tuple(tuple(args[i.slot].shape) for i in self.plan.inputs if i.role == "fixed")
            if fixed != bucket.fixed_shapes:
                return False
            for spec, static in zip(self.plan.inputs, bucket.args):
                if spec.role == "metadata" and any(
                        s > t for s, t in zip(args[spec.slot].shape[1:], static.shape[1:])):
                    return False
        return True

    # ----------------------------------------------------------------------------------- a call
    def captured(self, b: int) -> bool:
        return b in self._captured

    def capture(self, args: Sequence[Any], n: int, b: int, empty: bool = False) -> str | None:
        """Captures bucket ``b`` with this call's data in its static buffers (``empty``: with no live row
        and no request, for a bucket the call does not fit: ``capture="all"``); on failure (here, or on
        another rank of the TP group: the executor settles each capture) records the bucket in
        ``failed_buckets`` and returns why."""
        bucket = self._allocate(args, n, b)
        if not empty:  # freshly allocated buffers hold zeros and padding: a forward of nothing
            self._copy_in(bucket, args, n)
        fn = _WholeForward(self._live_forward, bucket.env, self._tensor_outputs)
        try:
            with self.executor.capture_session():
                bucket.outputs = tuple(self.executor.capture((-1, b), fn, bucket.args))
        except Exception as e:
            self.failed_buckets[b] = f"{type(e).__name__}: {e}"
            return self.failed_buckets[b]
        self._captured[b] = bucket
        counters.captures += 1
        log.info("%s: whole-stage graph captured at bucket %d (%d requests)", self._stage, b, bucket.requests)
        return None

    def serve(self, args: Sequence[Any], env_live: Env, n: int, b: int) -> tuple[Any, ...]:
        """The forward of ``n`` live tokens replayed at whole bucket ``b`` (captured)."""
        bucket = self._captured[b]
        self._copy_in(bucket, args, n)
        outputs = self.executor.replay((-1, b), bucket.args)
        counters.replays += 1
        counters.whole_replays += 1
        counters.replays_by_bucket[b] += 1
        for spec, static in zip(self.plan.inputs, bucket.args):
            if spec.written:  # an in-place write of an input reaches the caller's tensor
                narrow_to(args[spec.slot], spec.dims, env_live).copy_(narrow_to(static, spec.dims, env_live))
        return self._outputs(outputs, env_live)

    def _outputs(self, graph_outputs: Sequence[Any], env_live: Env) -> tuple[Any, ...]:
        results: list[Any] = []
        tensors = iter(graph_outputs)
        for kind, what in self.plan.outputs:
            if kind == "tensor":
                view = narrow_to(next(tensors), what, env_live)
                results.append(view.clone() if self._owned else view)
            elif kind == "size":
                results.append(what(env_live))
            else:
                results.append(what)
        return tuple(results)

    # ----------------------------------------------------------------------------------- buffers
    def _allocate(self, args: Sequence[Any], n: int, b: int) -> _Bucket:
        requests = self.plan.requests_for(b)
        env: Env = {self._token: b}
        statics: list[Any] = []
        for spec in self.plan.inputs:
            value = args[spec.slot]
            if spec.role in ("token", "fixed"):
                shape = list(value.shape)
                for d, size_of in spec.dims:
                    shape[d] = size_of(env)  # the bucket's size of the dim (2 * b for a [2T, ...] input)
                statics.append(torch.zeros(shape, dtype=value.dtype, device=value.device))
            elif spec.role == "metadata":
                assert spec.metadata is not None
                statics.append(metadata_buffer(value, spec.metadata, b, requests))
            else:
                statics.append(value)
        for symbol, slot, dim in self.plan.bound_symbols:
            env[symbol] = int(statics[slot].shape[dim])
        for k, spec in enumerate(self.plan.inputs):
            if spec.role == "size":
                assert spec.symbol is not None
                statics[k] = env[spec.symbol]
        fixed = tuple(tuple(args[i.slot].shape) for i in self.plan.inputs if i.role == "fixed")
        return _Bucket(tuple(statics), env, requests, fixed)

    def _copy_in(self, bucket: _Bucket, args: Sequence[Any], n: int) -> None:
        env_live = {self._token: n}
        for spec, static in zip(self.plan.inputs, bucket.args):
            value = args[spec.slot]
            if spec.role == "token":
                copy_in(static, value, spec.dims, env_live, bucket.env)
            elif spec.role == "fixed":
                static.copy_(value)
            elif spec.role == "metadata":
                assert spec.metadata is not None
                pad_metadata(static, value, spec.metadata)

    def buffers(self, b: int) -> dict[str, torch.Tensor]:
        """The static buffers of captured bucket ``b`` by input name (token inputs, fixed inputs and
        metadata, as the last call left them; read-only)."""
        bucket = self._captured[b]
        return {spec.name: a for spec, a in zip(self.plan.inputs, bucket.args)
                if spec.role in ("token", "fixed", "metadata")}

    def static_tensors(self) -> list[torch.Tensor]:
        """Every static buffer of every captured bucket (for aliasing checks and memory reports)."""
        return [a for bucket in self._captured.values() for spec, a in zip(self.plan.inputs, bucket.args)
                if spec.role in ("token", "fixed", "metadata")]


def describe_plan(plan: WholeStagePlan | None, reason: str | None, buckets: Sequence[int]) -> str:
    """One line for ``describe()``: the whole-stage buckets, or why there are none."""
    if plan is None:
        return f"whole-stage graphs: none ({reason})" if reason else "whole-stage graphs: none"
    served = [b for b in buckets if b <= plan.max_tokens]
    return (f"whole-stage graphs: buckets {served} (up to {plan.max_tokens} tokens; capturable breaks: "
            f"{', '.join(plan.ops)})")


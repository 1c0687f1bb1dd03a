"""Marking token dims dynamic: the cheaper way to give Dynamo a symbolic token count.

``torch.compile(stage, dynamic=True)`` makes every size symbolic, and also passes every float attribute
of the stage's modules (an RMSNorm's ``eps``, two per decoder layer) as a 0-d tensor graph input that
Dynamo builds and guards on each call. On a 32-layer stage that is about 1 ms of host time per forward
(docs/benchmarks.md), for pp_breakable and whole-graph Inductor alike. Marking only the token dims of
the first call's inputs (``torch._dynamo.mark_dynamic``, as vLLM does) gives the same symbolic token
count, keeps those floats constants, and keeps other dims static (no duck sizing against the hidden
size either).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ppcompile.torch_internals import mark_dynamic

__all__ = ["mark_token_dynamic", "tensors_in"]

log = logging.getLogger(__name__)


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``value``: a tensor, or mappings (a ``dict``, ``PPProxyTensors``), lists and tuples
    of them; anything else holds none."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from tensors_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors_in(v)


def mark_token_dynamic(*values: Any, dim: int = 0) -> int:
    """Marks ``dim`` (the token dim) of every tensor in ``values`` dynamic for Dynamo's next trace.

    ``values`` may hold tensors, mappings (a ``dict`` or ``PPProxyTensors`` of proxies), lists and
    tuples of them, and anything else (``None``, ints), which is skipped. Call it on the first call's
    inputs before that call; Dynamo's dynamic graph then serves every later token count. Tensors with
    no dim ``dim`` are skipped. Returns how many tensors were marked. Each tensor gets a symbol of its
    own unless an op relates them; ``find_token_dims`` reads those equal at this call as one token count.

    Example::

        ppcompile.mark_token_dynamic(input_ids, positions, proxies)
        out = compiled(input_ids, positions, pp_proxy_tensors=proxies)
    """
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
        raise ValueError(f"mark_token_dynamic: dim must be a non-negative int, got {dim!r}")
    marked = 0
    for t in tensors_in(values):
        if t.dim() <= dim:
            continue
        if t.shape[dim] == 1 and t.dim() > dim + 2 and t.shape[dim + 1] > 1:  # [1, T, H]: batch-first?
            log.warning("mark_token_dynamic: a tensor of shape %s has size 1 at dim %d, which Dynamo "
                        "treats as a constant (the stage then never graphs); batch-first? ppcompile "
                        "stages are token-major ([T, ...]): squeeze the batch dim, or pass dim=%d",
                        list(t.shape), dim, dim + 1)
        mark_dynamic(t, dim)
        marked += 1
    return marked

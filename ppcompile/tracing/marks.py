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

__all__ = ["TokenMarking", "mark_first_call", "mark_token_dynamic", "tensors_in"]

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


class TokenMarking(torch.nn.Module):
    """A stage that marks the token dims of its first call's inputs dynamic, then runs ``stage``.

    For drivers that make a stage's input tensors themselves, so that a user cannot mark them before the
    first call: ``torch.distributed.pipelining`` chunks every step's batch into micro-batches. Unmarked,
    Dynamo traces the first call at its concrete sizes (a static graph, served eagerly) and compiles a
    symbolic one only when a later call brings another token count; a pipeline whose steps all hold the
    same count would never reach the graph path. Marked: dim ``dim`` of every tensor of the first call
    whose size there equals that of the first tensor (the token count; a table or a mask of another size
    stays static), as :func:`mark_token_dynamic` marks them.
    """

    def __init__(self, stage: Any, dim: int = 0) -> None:
        super().__init__()
        self.stage, self.dim, self.marked = stage, dim, False

    def __getattr__(self, name: str) -> Any:
        """Other attributes are the stage's, as ``torch.compile``'s module passes them through to the
        module it wraps (a traced pipelining stage reads its module's ``graph``)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("stage"), name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.marked:
            self.marked = True
            sized = [t for t in tensors_in((args, kwargs)) if t.dim() > self.dim]
            if sized:
                tokens = sized[0].shape[self.dim]
                mark_token_dynamic([t for t in sized if t.shape[self.dim] == tokens], dim=self.dim)
        return self.stage(*args, **kwargs)


def mark_first_call(stage: Any, dim: int = 0) -> TokenMarking:
    """``stage`` (a compiled module or function) wrapped so that its first call marks its token dims
    (:class:`TokenMarking`); use it where the driver creates the inputs::

        PipelineStage(ppcompile.mark_first_call(torch.compile(stage_module, backend="pp_breakable")), ...)
    """
    return TokenMarking(stage, dim)

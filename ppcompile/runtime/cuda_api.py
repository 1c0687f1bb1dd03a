"""``CudaApi``: the CUDA calls of ``CudaGraphExecutor``, as one object the executor is given.

The executor never reads ``torch.cuda`` itself: it calls the ``CudaApi`` it was made with (default
:data:`TORCH_CUDA`, over ``torch.cuda``), so a test hands it a double of the same names
(``tests/cuda_double.py``) through the executor factory (``make_executor(..., cuda=...)``) instead of
patching torch. The calls are bound once, when the object is made: a call through it costs what a call
through ``torch.cuda`` does, and a replay (``CUDAGraph.replay``, bound by the executor) goes through
nothing of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ppcompile.torch_internals import cuda_graph_capture

__all__ = ["TORCH_CUDA", "CudaApi"]


class CudaApi:
    """The ``torch.cuda`` calls on the capture and replay path, bound from ``module`` (``torch.cuda``, or
    any object with the same names: ``current_device``, ``device``, ``graph_pool_handle``, ``Stream``,
    ``stream``, ``current_stream``, ``CUDAGraph``, ``synchronize``, ``empty_cache``)."""

    def __init__(self, module: Any = torch.cuda) -> None:
        self.current_device: Any = module.current_device
        self.device: Any = module.device
        self.graph_pool_handle: Any = module.graph_pool_handle
        self.Stream: Any = module.Stream
        self.stream: Any = module.stream
        self.current_stream: Any = module.current_stream
        self.CUDAGraph: Any = module.CUDAGraph
        self.synchronize: Any = module.synchronize
        self.empty_cache: Any = module.empty_cache

    @contextlib.contextmanager
    def capture(self, graph: Any, pool: Any, stream: Any) -> Iterator[None]:
        """``torch_internals.cuda_graph_capture`` of the block into ``graph`` on ``stream``, the stream
        entered through this API (``cuda_graph_capture`` is given none, for which ``torch.cuda.stream``
        does nothing)."""
        with self.stream(stream), cuda_graph_capture(graph, pool, None):
            yield


TORCH_CUDA = CudaApi()
"""The CUDA API of every executor not given another: ``torch.cuda`` itself."""

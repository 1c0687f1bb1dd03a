"""Where a CUDA graph capture's host time goes: warm-ups, capture begin, recording (the segment run under
capture), capture end (instantiation) and the replay after it, per graph, and the runtime's own time
around the executor.

:class:`CapturePhases` makes the executors of the stages built while it is installed (``install()``): the
default ``CudaGraphExecutor``, given a CUDA API whose capture block is timed (``TimedCudaApi``) and timing
each ``capture`` call. Host time only, no extra synchronisation: a phase that blocks on device work
queued by an earlier one absorbs that work's time (a capture end, say). On another graph mode the default
executor is made and nothing is timed. ``bench/lazy_capture.py`` runs it on its ``capture="all"`` row
(issue 51: about 2.7 ms per graph on the first GPU run, against a 1 ms target).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ppcompile.observe.hooks import StageHooks, observe_stages
from ppcompile.runtime.cuda_api import CudaApi
from ppcompile.runtime.executors import CudaGraphExecutor, GraphExecutor, make_executor
from ppcompile.runtime.group_agreement import Agreement

__all__ = ["PHASES", "CapturePhases", "TimedCudaApi"]

PHASES = ("warm-ups", "capture begin", "recording", "capture end", "replay and the rest")


class TimedCudaApi(CudaApi):
    """``torch.cuda`` (or ``module``) with its capture block timed into ``phases``."""

    def __init__(self, phases: CapturePhases, module: Any = torch.cuda) -> None:
        super().__init__(module)
        self._phases = phases

    @contextlib.contextmanager
    def capture(self, graph: Any, pool: Any, stream: Any) -> Iterator[None]:
        phases = self._phases
        entered = time.perf_counter()
        phases.add("warm-ups", entered - phases.started)
        with CudaApi.capture(self, graph, pool, stream):
            began = time.perf_counter()
            phases.add("capture begin", began - entered)
            yield
            recorded = time.perf_counter()
            phases.add("recording", recorded - began)
        phases.ended = time.perf_counter()
        phases.add("capture end", phases.ended - recorded)


class CapturePhases:
    """Host seconds per capture phase (:data:`PHASES`) summed over graphs, and graphs captured."""

    def __init__(self, cuda: Any = torch.cuda) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.graphs = 0
        self.started: float = 0.0  # the current capture call's start
        self.ended: float = 0.0  # its capture end
        self._api = TimedCudaApi(self, cuda)

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def executor(self, mode: str, debug: bool, device: torch.device | None,
                 agreement: Agreement) -> GraphExecutor:
        """An ``executors.ExecutorFactory``: timed CUDA graph executors, any other mode's default."""
        if mode != "cuda":
            return make_executor(mode, debug, device, agreement)
        phases = self

        class TimedExecutor(CudaGraphExecutor):
            def capture(self, key: Any, fn: Callable[..., Any], args: Sequence[Any], shapes: Any = None,
                        strides: Any = None) -> tuple[Any, ...]:
                phases.started = time.perf_counter()
                outputs = super().capture(key, fn, args, shapes, strides)
                phases.add("replay and the rest", time.perf_counter() - phases.ended)
                phases.graphs += 1
                return outputs

        return TimedExecutor(debug, device=device, agreement=agreement, cuda=self._api)

    @contextlib.contextmanager
    def install(self) -> Iterator[CapturePhases]:
        """Stages built inside the block get their executors from :meth:`executor`."""
        remove = observe_stages(StageHooks(built=lambda runtime: runtime.use_executor(self.executor)))
        try:
            yield self
        finally:
            remove()

    def ms_per_graph(self) -> dict[str, float]:
        """Each phase's mean ms per graph (empty before a graph)."""
        if not self.graphs:
            return {}
        return {phase: 1e3 * self.seconds[phase] / self.graphs for phase in PHASES}

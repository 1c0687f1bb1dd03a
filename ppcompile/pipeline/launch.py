"""``spawn_ranks``: run a function in N fresh processes that form a process group on loopback.

Used by the tests and by ``python -m ppcompile demo --pp N --distributed``; under torchrun, torchrun plays
this part. The first rank that raises or dies fails the whole run with that rank's error; a rank blocked on
a dead peer never makes the run hang (the others are terminated, and process groups have timeouts).
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import queue
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ppcompile.pipeline.groups import DEFAULT_TIMEOUT_S, init_pipeline_group

__all__ = ["RankError", "spawn_ranks"]


class RankError(RuntimeError):
    """A rank of :func:`spawn_ranks` raised or died; ``rank`` names it, the message carries its traceback."""

    def __init__(self, rank: int, world_size: int, error: str, remote_traceback: str = "") -> None:
        text = f"rank {rank} of {world_size} failed: {error}"
        if remote_traceback:
            text += f"\n--- traceback of rank {rank} ---\n{remote_traceback.rstrip()}"
        super().__init__(text)
        self.rank = rank
        self.error = error


def spawn_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    pg_timeout_s: float = 60.0,
    backend: str = "gloo",
    threads: int | None = None,
    start_method: str | None = None,
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` in ``world_size`` new processes; returns their results by rank.

    The processes form the default process group (``backend``, timeout ``pg_timeout_s``) through a
    rendezvous store that this process hosts on 127.0.0.1 (a free port picked by the OS). The first rank
    that raises or dies fails the run: the others are terminated and :class:`RankError` carries that
    rank's error and traceback. A run still going after ``timeout_s`` (None: no limit; the process-group
    timeout still bounds every stalled send and recv) is terminated with ``TimeoutError``.
    ``fn`` must be importable by name (a module-level function) and its result picklable by
    ``torch.save``. ``threads`` sets ``torch.set_num_threads`` in each process.

    ``start_method`` defaults to ``"forkserver"`` where available (one clean server process imports torch
    and ppcompile once, each rank is a fork of it: seconds faster per rank than ``"spawn"``; this sets the
    forkserver's preload list if the server has not started yet), else ``"spawn"``. Never ``"fork"`` from a
    process that may have started CUDA or torch threads.
    """
    if world_size < 1:
        raise ValueError(f"spawn_ranks: world_size must be >= 1, got {world_size}")
    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx: Any = mp.get_context(start_method)  # typeshed: BaseContext has no Process
    if start_method == "forkserver":
        ctx.set_forkserver_preload([__name__])  # only takes effect before the server starts
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=pg_timeout_s),
                          wait_for_workers=False)
    results: Any = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, name=f"ppcompile-rank{rank}",
                    args=(fn, rank, world_size, store.port, backend, pg_timeout_s, threads, tuple(args),
                          results))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    ok = False
    try:
        values = _collect(procs, results, timeout_s)
        ok = True
        return values
    finally:
        _stop(procs, grace_s=10.0 if ok else 0.0)
        results.close()
        del store


def _collect(procs: Sequence[Any], results: Any, timeout_s: float | None) -> list[Any]:
    """Reads one message per rank; raises on the first error, a silent death, or the deadline."""
    world_size = len(procs)
    deadline = time.monotonic() + (float("inf") if timeout_s is None else timeout_s)
    values: dict[int, Any] = {}
    while len(values) < world_size:
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(set(range(world_size)) - set(values))
            raise TimeoutError(f"spawn_ranks: rank(s) {missing} of {world_size} still running after "
                               f"{timeout_s:g} s; terminated them (raise timeout_s for longer runs)")
        try:
            rank, ok, payload = results.get(timeout=min(0.5, left))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode is not None]
            if not dead:
                continue
            try:  # a rank's last message may still be in the pipe when its exit is seen
                rank, ok, payload = results.get(timeout=2.0)
            except queue.Empty:
                code = procs[dead[0]].exitcode
                raise RankError(dead[0], world_size, f"exited with code {code} without reporting") from None
        if not ok:
            raise RankError(rank, world_size, *payload)
        values[rank] = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)  # our children
    return [values[r] for r in range(world_size)]


def _stop(procs: Sequence[Any], grace_s: float) -> None:
    """Joins the ranks (``grace_s`` to exit on their own), then terminates, then kills what is left."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    pg_timeout_s: float,
    threads: int | None,
    args: tuple[Any, ...],
    results: Any,
) -> None:
    """Body of one spawned rank: join the group, run ``fn``, report its result or its error."""
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        timeout = datetime.timedelta(seconds=pg_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout)
        init_pipeline_group(backend=backend, timeout_s=pg_timeout_s, store=store, rank=rank,
                            world_size=world_size)
        value = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException as e:  # report everything (KeyboardInterrupt and SystemExit included)
        results.put((rank, False, (f"{type(e).__name__}: {e}", traceback.format_exc())))
        results.close()
        results.join_thread()  # the report is in the pipe before this rank's sockets close
        sys.exit(1)
    dist.destroy_process_group()

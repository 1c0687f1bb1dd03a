"""Agreement inside a TP group: every rank takes the same path, bucket and capture decisions.

A stage whose collectives run in graph segments launches them at the bucket size when it replays and at
the live size when it runs eagerly. Ranks of one group that chose differently would launch collectives of
different shapes: the group hangs, or sums padded rows into live ones. Most decisions agree by
construction: the bucket, the padding guard and the cap are functions of the token count and the
options, which the ranks of a group share; autograd and the stage graph Dynamo picks follow from the same
code and inputs. What can differ between ranks is agreed here, at a stage's first call and at capture
time only, with small collectives on the group:

- that the ranks were called with the same token count and compiled with the same options, graph mode
  included, at the first call on any path (else :class:`GroupDivergenceError` on every rank, before
  anything is captured or run);
- the order a capture budget spends on buckets (it follows the process's traffic): group rank 0's;
- where a capture budget ends (each rank measures its own time): at the first bucket boundary where any
  rank is over it;
- a capture that fails on some rank: the executor settles each (segment, bucket) capture with the group
  (:meth:`Agreement.settle`) after its warm-ups and capture and before anything it runs next (the CUDA
  executor's replay after capture, the next segment), and all ranks drop the bucket (``capture="lazy"``)
  or graphs (``"all"``), so none waits in a collective the others never launch. A failure part way
  through an eager run (a warm-up, or the emulated capture), after some ranks entered one of the
  segment's collectives, cannot be settled: those ranks wait until the process group's timeout.

Nothing is exchanged per forward, except with ``debug=True``, which checks every call's token count
across the group (one small collective) and fails with :class:`GroupDivergenceError` instead of hanging.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ppcompile.records import Collective
from ppcompile.torch_internals import resolve_process_group

__all__ = ["LOCAL", "Agreement", "GroupAgreement", "GroupCaptureError", "GroupDivergenceError",
           "agreement_for"]


class GroupDivergenceError(RuntimeError):
    """The ranks of a TP group were called with different token counts or compiled with different options:
    their collectives would disagree in shape."""


class GroupCaptureError(RuntimeError):
    """A capture failed on another rank of the TP group (``ranks``); this rank drops what it captured
    alike."""

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


class Agreement:
    """A group of one rank: every question is answered locally, without communication."""

    size = 1
    rank = 0

    def __init__(self) -> None:
        self.collectives = 0  # how many collectives this agreement has issued
        self._called = False  # whether a first call's token count and options were agreed

    def __repr__(self) -> str:
        return "Agreement(local)"

    def exchange(self, values: Sequence[int]) -> list[tuple[int, ...]]:
        """Every rank's ``values`` (the same length on every rank), by group rank."""
        return [tuple(values)]

    def check_same(self, what: str, values: Sequence[int], stage: str) -> None:
        """Raises :class:`GroupDivergenceError` on every rank unless all ranks hold the same ``values``."""
        rows = self.exchange(values)
        if any(row != rows[0] for row in rows):
            listed = "; ".join(f"rank {r}: {list(row)}" for r, row in enumerate(rows))
            raise GroupDivergenceError(
                f"pp_breakable: the ranks of {stage}'s TP group disagree on {what} ({listed}). Every rank "
                "of a TP group must run each forward with the same token count and compile the stage "
                "with the same options, or their collectives disagree in shape")

    def check_call(self, values: Sequence[int], stage: str, every_call: bool = False) -> None:
        """At a stage's first call on any path (at every call with ``every_call``, debug mode): the ranks
        hold the same ``values`` (the token count and the options' key, graph mode included)."""
        if self.size > 1 and (every_call or not self._called):
            self.check_same("the token count and options", values, stage)
            self._called = True

    def failed_ranks(self, ok: bool) -> list[int]:
        """The group ranks for which ``ok`` is False."""
        return [r for r, (flag,) in enumerate(self.exchange([int(ok)])) if not flag]

    def settle(self, error: BaseException | None) -> None:
        """Every rank calls this once per capture with its failure (or None): raises
        :class:`GroupCaptureError` on the ranks that succeeded when another failed (the failed ones
        raise their own error)."""
        failed = self.failed_ranks(error is None)
        if error is None and failed:
            raise GroupCaptureError(f"the capture failed on rank(s) {failed} of the TP group", failed)

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is True on some rank."""
        return any(f for (f,) in self.exchange([int(flag)]))

    def leader(self, values: Sequence[int]) -> list[int]:
        """Group rank 0's ``values`` (the same length on every rank)."""
        return list(self.exchange(values)[0])


LOCAL = Agreement()


class GroupAgreement(Agreement):
    """The ranks of ``group`` (a ``torch.distributed`` process group) answer together."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        super().__init__()
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def __repr__(self) -> str:
        return f"GroupAgreement(rank {self.rank} of {self.size})"

    def exchange(self, values: Sequence[int]) -> list[tuple[int, ...]]:
        import torch.distributed as dist

        mine = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        rows = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(rows, mine, group=self.group)
        self.collectives += 1
        return [tuple(int(v) for v in row.tolist()) for row in rows]


def agreement_for(tp_group: Any, collectives: Sequence[Collective], stage: str) -> Agreement:
    """How a stage's ranks agree: over ``tp_group`` (the option) or else the one group its traced
    collectives name; locally when that group has one rank or the stage has no collectives. Raises
    ``ValueError`` for collectives on several groups, or declared ones in a multi-rank world, without
    ``tp_group``: which ranks must agree is then unknown."""
    import torch.distributed as dist

    if tp_group is None and collectives:
        named = sorted({c.group for c in collectives if c.group is not None})
        if len(named) > 1:
            raise ValueError(f"pp_breakable: {stage} calls collectives on several process groups ({named}); "
                             "pass options={'tp_group': group} naming the group whose ranks run the stage")
        if named:
            tp_group = resolve_process_group(named[0])
        elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ops = sorted({c.op for c in collectives})
            raise ValueError(f"pp_breakable: {stage} calls collective op(s) {ops}, whose process group the "
                             "graph does not show; pass options={'tp_group': group} (the stage's TP group) "
                             "so that its ranks take the same decisions")
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return LOCAL
    return GroupAgreement(tp_group)

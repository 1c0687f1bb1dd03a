"""The capturable-break contract: a break op that declares how it can live inside a graph.

A break op (attention, an engine's cache write) runs eagerly between graph segments because it reads
per-forward metadata (sequence starts and lengths, KV slots, block tables) and must see only live rows.
An op whose engine declares it capturable reads that metadata from its tensor arguments only, and
promises what padded metadata means: a padded token row (KV slot ``-1``) writes nothing, a padded
request (zero length) reads and writes nothing, and no host work (no ``.item()``, no host ``plan()``)
happens in the op. Then ppcompile can lift the metadata into static buffers, pad them per bucket, and
capture the whole stage, attention included, as one graph per bucket up to ``whole_graph_tokens``
(``runtime/whole_stage.py``). A break op without a declaration stays a break, always.

Each metadata argument is named by the op's schema and says what its dim 0 counts:

* ``Rows.TOKENS``: one row per token (``slot_mapping [T]``); rows ``n:b`` get ``pad``;
* ``Rows.REQUESTS``: one row per request (``seq_lens [R]``, ``block_table [R, M]``); padded requests'
  rows get ``pad`` (0: zero-length);
* ``Rows.REQUEST_STARTS``: prefix sums over requests (``query_start_loc [R + 1]``); the padded tail
  repeats the last live entry, so padded requests have zero length and no row belongs to one.

Requests per bucket (the capacity of ``REQUESTS`` rows) default to the bucket's token count, as every
request of a prefill has a token; ``max_requests`` caps it. Another dim of a metadata argument that
varies per forward (blocks per request) takes its declared ``capacity``, or else its size at the call that
captures the bucket; a narrower forward gets the tail padded with ``pad``. A forward that exceeds a
capacity runs on the breakable path: nothing is ever truncated.

Example (the reference models' ``ppcompile::paged_attention``)::

    declare_capturable(
        "ppcompile::paged_attention",
        metadata={
            "query_start_loc": Metadata(Rows.REQUEST_STARTS),
            "seq_lens": Metadata(Rows.REQUESTS, pad=0),
            "block_table": Metadata(Rows.REQUESTS, pad=0, capacity={1: 64}),
            "slot_mapping": Metadata(Rows.TOKENS, pad=-1),
        },
    )
"""

from __future__ import annotations

import dataclasses
import enum
import types
from collections.abc import Mapping
from typing import Any

from ppcompile.torch_internals.ops import op_schema, qualified_op_name

__all__ = ["CapturableBreak", "Metadata", "Rows", "capturable_break", "capturable_breaks",
           "declare_capturable", "forget_capturable"]


class Rows(str, enum.Enum):
    """What dim 0 of a metadata argument counts (see the module docstring)."""

    TOKENS = "tokens"
    REQUESTS = "requests"
    REQUEST_STARTS = "request_starts"


@dataclasses.dataclass(frozen=True)
class Metadata:
    """One metadata argument: what its rows count, the value of padded rows and padded tails, and the
    fixed capacity of each other dim that varies per forward (dim -> size)."""

    rows: Rows
    pad: int | float = 0
    capacity: Mapping[int, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", Rows(self.rows))
        if self.rows is Rows.REQUEST_STARTS and self.pad != 0:
            raise ValueError("Metadata(Rows.REQUEST_STARTS) takes no pad: its padded tail repeats the last "
                             "live start (zero-length requests)")
        if not isinstance(self.pad, (int, float)) or isinstance(self.pad, bool):
            raise ValueError(f"Metadata.pad must be an int or float, got {self.pad!r}")
        for dim, size in self.capacity.items():
            if not isinstance(dim, int) or dim < 1 or not isinstance(size, int) or size < 1:
                raise ValueError(f"Metadata.capacity maps a dim >= 1 (dim 0 is the rows) to a size >= 1, "
                                 f"got {dim!r}: {size!r}")
        object.__setattr__(self, "capacity", dict(self.capacity))  # a copy (plans pickle it)

    def __hash__(self) -> int:
        return hash((self.rows, self.pad, tuple(sorted(self.capacity.items()))))


@dataclasses.dataclass(frozen=True)
class CapturableBreak:
    """A declared capturable break op: its metadata arguments by name, the requests per bucket, and, for
    an op that needs a host ``plan()`` per forward, why it is refused (``refused``)."""

    op: str
    metadata: Mapping[str, Metadata]
    max_requests: int | None = None
    refused: str | None = None

    def requests_for(self, bucket: int) -> int:
        """How many requests a whole-stage graph of ``bucket`` tokens holds."""
        return bucket if self.max_requests is None else min(bucket, self.max_requests)


_DECLARED: dict[str, CapturableBreak] = {}


def _schema_arguments(op: Any) -> list[str] | None:
    schema = op_schema(op)
    return None if schema is None else [a.name for a in schema.arguments]


def declare_capturable(
    op: Any,
    metadata: Mapping[str, Metadata],
    *,
    max_requests: int | None = None,
    host_plan: str | None = None,
    planned_outside: bool = False,
) -> CapturableBreak:
    """Declares the break op ``op`` (an op, or its ``"namespace::name"``) capturable (module docstring).

    ``host_plan``: what per-forward host planning the op needs (FlashInfer's ``plan()``, say); such an op
    is refused, the reason named in reports, unless ``planned_outside`` says the engine plans it before
    the forward into buffers the op reads (then the plan's outputs are metadata like any other).
    Raises ``ValueError`` for a metadata name the op's schema does not have. Declaring again replaces."""
    name = op if isinstance(op, str) else qualified_op_name(op) or ""
    if "::" not in name:
        raise ValueError(f"declare_capturable: {op!r} is not an op or a 'namespace::name'")
    if not metadata:
        raise ValueError(f"declare_capturable({name!r}): name at least one metadata argument; an op that "
                         "reads no per-forward metadata is token-local, not a break (token_local_ops)")
    if max_requests is not None and (not isinstance(max_requests, int) or max_requests < 1):
        raise ValueError(f"declare_capturable({name!r}): max_requests must be an int >= 1, got "
                         f"{max_requests!r}")
    arguments = _schema_arguments(op) if not isinstance(op, str) else None
    unknown = [m for m in metadata if arguments is not None and m not in arguments]
    if unknown:
        raise ValueError(f"declare_capturable({name!r}): {unknown} are not arguments of the op "
                         f"(its arguments: {arguments})")
    refused = None
    if host_plan and not planned_outside:
        refused = (f"needs a host plan() per forward ({host_plan}), which a graph would replay stale: plan "
                   "it before the forward into buffers the op reads, and declare planned_outside=True")
    entry = CapturableBreak(name, types.MappingProxyType(dict(metadata)), max_requests, refused)
    _DECLARED[name] = entry
    return entry


def forget_capturable(op: Any) -> None:
    """Removes a declaration (tests, or an engine that unloads its ops)."""
    _DECLARED.pop(op if isinstance(op, str) else qualified_op_name(op) or "", None)


def capturable_break(name: str) -> CapturableBreak | None:
    """The declaration of the op ``"namespace::name"``, if any."""
    return _DECLARED.get(name)


def capturable_breaks() -> Mapping[str, CapturableBreak]:
    """Every declaration, by op name (read-only)."""
    return types.MappingProxyType(_DECLARED)

"""The graph path of a stage as straight-line Python, generated once per stage and bound once per bucket.

``make_graph_forward`` compiles ``bind_graph_forward``; a stage instance's ``GraphPath``
(``graph_path.py``) calls it once per captured bucket with what that bucket never changes (its slot table,
one replay callable per graph step, the fused copiers, the output ring, a cache of views, the padding
marks) and keeps the function it returns, ``graph_forward(args, env_n, n)``: a call passes only the
live inputs, the call's symbol values and its live token count. For the three-step program of
``codegen.py`` (a binding executor, one token dim per buffer, sizes the token symbol itself)::

    def bind_graph_forward(b, table, replays, copiers, ring, views, marks):
        static = table
        replay_0, replay_2, = replays
        def graph_forward(args, env_n, n):
            v0, v1, v2 = args
            step = -1
            try:
                D = views.get(n)
                if D is None:
                    if len(views) >= 64:
                        views.clear()
                    D = views[n] = (static[0][:n], ..., static[3] if static[3].shape[0] == n else ...)
                dst0, dst1, dst5, v3, = D
                if marks[0] != n:
                    zero_stale_rows(static[0], 0, n, b, marks, 0)
                dst0.copy_(v0)
                ...
                step = 0
                replay_0()
                step = 1
                v5 = call_1(v3)
                if marks[2] != n:
                    zero_stale_rows(static[5], 0, n, b, marks, 2)
                dst5.copy_(v5)
                ...
            except BaseException as e:
                raised(e, step, n, b)
                raise
            return (v6, n)
        return graph_forward
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy

from ppcompile.errors import add_note
from ppcompile.runtime import static_buffers
from ppcompile.runtime.codegen import _call_segment, _exec, _function, _outputs, _Sizes
from ppcompile.runtime.program import CopyPoint, GraphStep, Program, Ref
from ppcompile.symbolic import SizeFn

__all__ = ["COPY_FUNCTIONS", "VIEW_CACHE", "CopyFunctions", "GraphForward", "GraphPathBinder",
           "graph_forward_source", "make_graph_forward", "pad_marks", "replay_passes_args"]

GraphForward = Callable[[Sequence[Any], Mapping[sympy.Symbol, int], int], tuple[Any, ...]]
GraphPathBinder = Callable[..., GraphForward]


def replay_passes_args(binds_inputs: bool, debug: bool) -> bool:
    """Whether the graph path hands each replay its arguments: a bound graph reads what it captured, so
    they matter only to a non-binding executor and to the debug address check."""
    return not binds_inputs or debug


CopyFunctions = Mapping[str, Callable[..., Any]]  # by the name the generated code calls it

COPY_FUNCTIONS: CopyFunctions = types.MappingProxyType({
    "copy_rows": static_buffers.copy_rows, "copy_in": static_buffers.copy_in,
    "bridge_rows": static_buffers.copy_rows, "bridge_in": static_buffers.copy_in,
    "copy_out": static_buffers.copy_out,
})
"""The copy functions the graph path calls: live inputs (``copy_rows``, ``copy_in``), bridges
(``bridge_*``, the same functions) and outputs into their ring slot (``copy_out``); instrumentation
wraps them by category (``graph_path.copy_category``)."""


class _PathSizes(_Sizes):
    """Sizes on the graph path: the token symbol itself is ``direct`` (``n`` or ``b``); with ``fixed``
    (the bucket's side), an expression of the token symbol alone is evaluated once per bucket, when the
    path is bound, from ``bucket_env``."""

    def __init__(self, prefix: str, env: str, names: dict[str, Any], token: sympy.Symbol, direct: str,
                 fixed: bool = False) -> None:
        super().__init__(prefix, env, names)
        self.token, self.direct, self.fixed = token, direct, fixed
        self.bound: dict[sympy.Expr, str] = {}

    def __call__(self, size: SizeFn) -> str:
        if size.expr == self.token:
            return self.direct
        if not (self.fixed and size.expr.free_symbols <= {self.token}):
            return super().__call__(size)
        local = self.bound.get(size.expr)
        if local is None:
            local = self.bound[size.expr] = f"{self.prefix}{len(self.locals) + len(self.bound)}"
            self.names[f"size_{local}"] = size
        return local

    def binding(self) -> list[str]:
        return [f"    {local} = size_{local}(bucket_env)" for local in self.bound.values()]


def graph_forward_source(
    program: Program, token: sympy.Symbol, binds_inputs: bool, pass_args: bool,
    copies: CopyFunctions | None = None, fused: bool = False,
) -> tuple[str, dict[str, Any]]:
    """The generated source of ``program``'s graph path and the globals it reads: ``bind_graph_forward(b,
    table, replays, copiers, ring, views, marks)`` binds what one bucket ``b`` never changes (its slot
    table, a replay per graph step, the fused copiers, the output ring, its copy-view cache, the
    instance's padding marks, the sizes of ``b``) and returns ``graph_forward(args, env_n, n)``, which
    serves a call of ``n`` live tokens at ``b``.

    ``token``: the token symbol (``n`` and ``b`` are its values). ``binds_inputs``: the replays read what they
    captured (a CUDA graph), so their outputs stay in the table; else each replay returns its outputs, written
    into a per-call copy of the table. ``pass_args``: hand each replay its arguments (a non-binding executor,
    or the debug address check); else a replay takes none. A call copies the live inputs into their static
    buffers (zeroing the padding rows an earlier call wrote), replays graph segments, narrows what breaks and
    callers read to the live size, runs breaks on live tensors and copies what graphs read into static
    bridges; last, it copies each input a graph wrote in place back into the caller's tensor, and with an
    ``output_ring``, each output in static memory into the ring's next slot (claimed first: it waits for the
    sends still reading it). ``copies``: the copy functions (default :data:`COPY_FUNCTIONS`; a profiler wraps
    them). ``fused``: each copy point (``Program.copy_points``) fills its ``fused`` buffers with one call of
    its copier (``copy_<point>((v0, v1), (n, n), (b, b))``) instead of a copy and a zeroing per tensor; its
    other buffers are filled by torch ops.
    """
    names: dict[str, Any] = {"narrow_to": static_buffers.narrow_to, "token": token,
                             "zero_stale_rows": static_buffers.zero_stale_rows, **(copies or COPY_FUNCTIONS)}
    live = _PathSizes("n", "env_n", names, token, "n")
    bucket = _PathSizes("b", "env_b", names, token, "b", fixed=True)
    body: list[str] = []
    # Unwrapped copy functions (no profiler): one-dim copies are written inline, not called.
    inline = all(names[k] is f for k, f in COPY_FUNCTIONS.items())
    row_views: dict[int, tuple[int, str, str | None]] = {}  # slot -> (token dim, live size, bucket size)
    # Live views of a binding executor's table, made once per set of sizes: slot -> (token dim, live size).
    live_views: dict[int, tuple[int, str, str]] = {}  # ... and the prefix of the name bound
    marks = pad_marks(program, fused)
    handed_out = {r.slot for r in program.outputs if isinstance(r, Ref)}  # fresh views: callers may restride

    def dims_of(slot: int) -> tuple[tuple[int, SizeFn], ...]:
        return program.token_dims.get(slot, ())

    def fill(buf: str, src: str, slot: int, kind: str) -> None:
        """``buf``'s first rows from ``src``; its padding rows up to the bucket zeroed (``copy_in``).
        ``kind``: ``"copy"`` (a live input) or ``"bridge"`` (a break output)."""
        dims = dims_of(slot)
        if not dims:
            body.append(f"{kind}_in({buf}, {src}, (), env_n, env_b)")
        elif len(dims) == 1:
            (d, size), = dims
            n, b = live(size), bucket(size)
            k = marks.get(slot)
            if k is not None:  # only rows an earlier call wrote past n are zeroed
                body.extend([f"if marks[{k}] != {n}:",
                             f"    zero_stale_rows(static[{slot}], {d}, {n}, {b}, marks, {k})"])
            if inline:  # static_buffers.copy_rows on views made once per set of sizes (_cached_views)
                row_views.setdefault(slot, (d, n, None if k is not None else b))
                body.append(f"dst{slot}.copy_({src})")
                if k is None:
                    body.extend([f"if {b} > {n}:", f"    pad{slot}.zero_()"])
            else:
                body.append(f"{kind}_rows({buf}, {src}, {d}, {n}, {b})")
        else:
            names[f"dims_{slot}"] = dims
            body.append(f"{kind}_in({buf}, {src}, dims_{slot}, env_n, env_b)")

    def view(slot: int, made: bool = False) -> None:
        """``v<slot>``: the static value narrowed to the live size along its token dims (``made``: a
        graph output, bound where the cached views are unpacked)."""
        dims = dims_of(slot)
        if not dims:
            body.append(f"v{slot} = static[{slot}]")
        elif len(dims) == 1:
            (d, size), = dims
            n = live(size)
            if binds_inputs and slot not in handed_out:  # the table is the bucket's: views kept
                live_views.setdefault(slot, (d, n, "v" if made else "w"))
                if not made:
                    body.append(f"v{slot} = w{slot}")
                return
            body.extend([f"t = static[{slot}]",
                         f"v{slot} = t if t.shape[{d}] == {n} else t[{_leading(d, f':{n}')}]"])
        else:
            names[f"dims_{slot}"] = dims
            body.append(f"v{slot} = narrow_to(static[{slot}], dims_{slot}, env_n)")

    def fill_point(point: CopyPoint) -> None:
        """Fills the static buffers of ``point``: one copier call for its fused ones, or each on its own."""
        fused_slots = point.fused if fused else ()
        if fused_slots:

            def sizes(of: Callable[[SizeFn], str], s: int) -> str:
                dims = dims_of(s)
                return of(dims[0][1]) if dims else "0"

            srcs = ", ".join(f"v{s}" for s in fused_slots)
            ns = ", ".join(sizes(live, s) for s in fused_slots)
            bs = ", ".join(sizes(bucket, s) for s in fused_slots)
            body.append(f"copy_{point.index}(({srcs},), ({ns},), ({bs},))")
        kind = "copy" if point.after is None else "bridge"
        for slot in point.slots:
            if slot not in fused_slots:
                fill(f"static[{slot}]", f"v{slot}", slot, kind)

    fill_point(program.copy_in)
    for step in program.steps:
        body.append(f"step = {step.index}")
        if isinstance(step, GraphStep):
            args = ""
            if pass_args:
                args = ", ".join(bucket(r.size) if r.size is not None else f"static[{r.slot}]"
                                 for r in step.args)
                args = f"({args}{',' if len(step.args) == 1 else ''})"
            if binds_inputs:
                body.append(f"replay_{step.index}({args})")
            else:
                body.append(f"o = replay_{step.index}({args})")
                body += [f"static[{s}] = o[{i}]" for i, s in step.writes]
            for s in step.live_views:
                view(s, made=True)
            for s in step.writes_buffers:
                view(s)  # a static value the graph wrote in place: read back from its buffer
            body += [f"v{s} = static[{s}]" for s in step.live_values]
        else:
            args = ", ".join(live(r.size) if r.size is not None else f"v{r.slot}" for r in step.args)
            body.append(_call_segment(step, args, names))
            if step.copies is not None:
                fill_point(step.copies)
    body[:0] = _cached_views(row_views, live_views, set(bucket.bound.values()) | {"b"})
    body += [f"args[{s}].copy_(v{s})" for s in program.written_inputs]  # the caller's tensor, as eager
    ring = program.output_ring
    if ring is not None:
        body.append("ring_buffers = ring.take().claim()")  # waits for the sends still reading this slot
        for j, s in enumerate(ring.slots):  # ring_buffers[j] holds slot s
            names[f"ring_layout_{j}"] = ring.layouts[j]
            body.append(f"v{s} = copy_out(ring_buffers[{j}], v{s}, ring_layout_{j}, env_n)")
    outputs = _outputs(program, live, names)
    prologue = [] if binds_inputs else ["    static = list(table)"]  # this call's outputs go here
    if "env_b" in "\n".join(body) or bucket.locals:
        prologue.append("    env_b = {**env_n, token: b}")
    prologue += live.prologue() + bucket.prologue()
    inner = _function("def graph_forward(args, env_n, n):", program.num_inputs, prologue, body,
                      "raised(e, step, n, b)", outputs)
    graph_steps = [f"replay_{st.index}" for st in program.graph_steps]
    outer = ["def bind_graph_forward(b, table, replays, copiers, ring, views, marks):"]
    if binds_inputs:
        outer.append("    static = table")
    if graph_steps:
        outer.append(f"    {', '.join(graph_steps)}, = replays")
    if fused:
        outer += [f"    copy_{p.index} = copiers[{p.index}]" for p in program.copy_points if p.fused]
    if bucket.bound:
        outer += ["    bucket_env = {token: b}", *bucket.binding()]
    outer += [f"    {line}" if line else line for line in inner.splitlines()]
    outer.append("    return graph_forward")
    return "\n".join(outer) + "\n", names


VIEW_CACHE = 64
"""Per bucket, how many sets of copy views (one per distinct set of live sizes) a graph path keeps."""


def pad_marks(program: Program, fused: bool) -> dict[int, int]:
    """Static buffers whose padding rows only their copy points write, by slot: the index of the
    buffer's entry in ``marks`` (bridges sharing a buffer share it), which bounds the rows written
    since they were last zeroed (``static_buffers.zero_stale_rows``). Left out (zeroed up to the bucket
    every call): buffers a graph writes in place (a replay writes whole buffers, padding included), with
    other than one token dim, whose bucket views have per-bucket strides, or filled by a fused copier."""
    plans = program.buffers
    owner = {s: s if p.shares_with is None else p.shares_with for s, p in plans.items()}
    dims: dict[int, set[int]] = {}
    for s in plans:
        token_dims = program.token_dims.get(s, ())
        dims.setdefault(owner[s], set()).add(token_dims[0][0] if len(token_dims) == 1 else -1)
    out = {owner[s] for st in program.graph_steps for s in st.writes_buffers if s in owner}
    out |= {owner[s] for p in program.copy_points for s in p.fused} if fused else set()
    out |= {owner[s] for s, p in plans.items() if p.per_bucket_strides} | {o for o, d in dims.items()
                                                                          if len(d) > 1 or -1 in d}
    index: dict[int, int] = {}
    return {s: index.setdefault(owner[s], len(index)) for s in plans if owner[s] not in out}


def _cached_views(row_views: Mapping[int, tuple[int, str, str | None]],
                  live_views: Mapping[int, tuple[int, str, str]], fixed: set[str]) -> list[str]:
    """Lines binding, per set of sizes, views made once and kept in ``views`` (the bucket's cache, keyed
    by the sizes that change per call; ``fixed``: those that do not): ``dst<slot>`` (the live rows) and
    ``pad<slot>`` (the padding rows up to the bucket, unless ``zero_stale_rows`` zeroes them) of each
    static buffer filled along one token dim, and ``v<slot>`` (a graph output) or ``w<slot>`` (a buffer
    a graph wrote): the live view of each table value breaks read (the value itself at the bucket's
    size, as uncached). Breaks get the same view objects every call, as they always got the table's own
    tensor at the bucket's size: a break must not restride its inputs in place."""
    if not row_views and not live_views:
        return []
    sizes = sorted(({x for _, n, b in row_views.values() for x in (n, b) if x is not None}
                    | {n for _, n, _ in live_views.values()}) - fixed)
    key = sizes[0] if len(sizes) == 1 else f"({', '.join(sizes)}{',' if sizes else ''})"
    names: list[str] = []
    views: list[str] = []
    for s, (d, n, b) in row_views.items():
        names.append(f"dst{s}")
        views.append(f"static[{s}][{_leading(d, f':{n}')}]")
        if b is not None:
            names.append(f"pad{s}")
            views.append(f"static[{s}][{_leading(d, f'{n}:{b}')}]")
    for s, (d, n, v) in live_views.items():
        names.append(f"{v}{s}")
        views.append(f"static[{s}] if static[{s}].shape[{d}] == {n} else static[{s}][{_leading(d, f':{n}')}]")
    targets, made = ", ".join(names), ", ".join(views)
    return [f"D = views.get({key})",
            "if D is None:",
            f"    if len(views) >= {VIEW_CACHE}:",
            "        views.clear()",
            f"    D = views[{key}] = ({made},)",
            f"{targets}, = D"]


def _leading(dim: int, rows: str) -> str:
    """The index selecting ``rows`` (a slice's text) along ``dim``, every other dim whole: basic slicing
    makes the view ``narrow`` makes, at about half its host cost."""
    return ", ".join([":"] * dim + [rows])


def _annotate_graph_path(stage: str, segments: Sequence[str], e: BaseException, step: int, n: int,
                         b: int) -> None:
    where = f"segment {segments[step]}" if step >= 0 else "the input copy-in"
    add_note(e, f"pp_breakable: raised in {where} of {stage} ({n} tokens, bucket {b}); the stage stays "
             "usable: the next call rewrites every static buffer it reads")


def make_graph_forward(program: Program, stage: str, token: sympy.Symbol, binds_inputs: bool,
                       pass_args: bool, copies: CopyFunctions | None = None,
                       fused: bool = False) -> GraphPathBinder:
    """Compiles ``program``'s graph path (:func:`graph_forward_source`): ``bind(b, table, replays,
    copiers, ring, views, marks)`` returns the bucket's ``graph_forward(args, env_n, n)`` (``replays``:
    one callable per graph step, in order; ``copiers``: one per ``Program.copy_points`` entry when
    ``fused``; ``ring``: the instance's ``RingSlots``, or None; ``views``: a dict the bucket keeps;
    ``marks``: the instance's rows written per buffer, :func:`pad_marks`), which
    returns the stage's outputs at the live size (views into static memory)."""
    source, names = graph_forward_source(program, token, binds_inputs, pass_args, copies, fused)
    segments = tuple(st.segment.name for st in program.steps)
    fn: GraphPathBinder = _exec("bind_graph_forward", stage, source, names,
                                functools.partial(_annotate_graph_path, stage, segments))
    return fn

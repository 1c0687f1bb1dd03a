"""The per-call paths of a stage as straight-line Python, generated once per stage.

A ``StageRuntime`` call walks the program's steps: on the *live path* (``graph_mode="none"``, above the
capture cap, autograd on, a stage that cannot be graphed) every segment runs at the live size; on the
*graph path* graph segments replay their bucket's graph between copy-ins, live-size views and eager
breaks. Walking the steps in a loop costs 2-5 us per step (argument lists, slot tables, output
unpacking, size evaluation); this module generates, once per stage, functions that make the same
calls with locals, the way FX's own codegen does (:func:`make_live_forward`,
:func:`make_graph_forward`). Each distinct size expression is evaluated once per call, not per use.

Program (three steps, a size argument ``s0``; inputs 0 and 1 are live tensors, 2 a weight)::

    step 0  graph  submod_0(slot 0, slot 1, size s0)  -> slots 3, 4
    step 1  break  submod_1(slot 3)                    -> slot 5
    step 2  graph  submod_2(slot 5, slot 4, slot 2)    -> slot 6
    outputs: slot 6, size s0

Generated, for Inductor segments (the tensors they read that no guard or compiled segment vouches for
are checked against their traced layout ``L[k]``; see :class:`LiveLayouts`)::

    def live_forward(args, env):
        v0, v1, v2 = args
        z0 = size_z0(env)
        L = layouts(env)
        step = -1
        try:
            if not isinstance(v0, Tensor) or (v0.shape, v0.stride(), v0.dtype, v0.device) != L[0]:
                v0 = layouts.repair(0, v0, L[0])
            if not isinstance(v1, Tensor) or (v1.shape, v1.stride(), v1.dtype, v1.device) != L[1]:
                v1 = layouts.repair(1, v1, L[1])
            step = 0
            v3, v4 = call_0(v0, v1, z0)
            step = 1
            v5 = call_1(v3)
            if not isinstance(v5, Tensor) or (v5.shape, v5.stride(), v5.dtype, v5.device) != L[2]:
                v5 = layouts.repair(2, v5, L[2])
            step = 2
            v6 = call_2(v5, v4, v2)
        except BaseException as e:
            raised(e, step)
            raise
        return (v6, z0)

``raised`` adds a note naming the segment to the exception in flight (its type is unchanged).
The function holds the program's callables, never the runtime (no reference cycle).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy
import torch

from ppcompile.errors import add_note
from ppcompile.runtime import static_buffers
from ppcompile.runtime.layout_checks import CheckedValue, LiveLayouts
from ppcompile.runtime.program import CopyPoint, GraphStep, Program, Ref, Step
from ppcompile.symbolic import SizeFn

__all__ = ["COPY_FUNCTIONS", "CopyFunctions", "GraphForward", "LiveForward", "graph_forward_source",
           "live_forward_source", "make_graph_forward", "make_live_forward", "replay_passes_args"]

LiveForward = Callable[[Sequence[Any], Mapping[sympy.Symbol, int]], tuple[Any, ...]]
GraphForward = Callable[..., tuple[Any, ...]]


# ----------------------------------------------------------------------------------- shared pieces
class _Sizes:
    """Locals holding the value of each distinct size expression for one env (``env_n`` or ``env_b``)."""

    def __init__(self, prefix: str, env: str, names: dict[str, Any]) -> None:
        self.prefix, self.env, self.names = prefix, env, names
        self.locals: dict[sympy.Expr, str] = {}

    def __call__(self, size: SizeFn) -> str:
        local = self.locals.get(size.expr)
        if local is None:
            local = self.locals[size.expr] = f"{self.prefix}{len(self.locals)}"
            self.names[f"size_{local}"] = size
        return local

    def prologue(self) -> list[str]:
        return [f"    {local} = size_{local}({self.env})" for local in self.locals.values()]


def _call_segment(step: Step, args: str, names: dict[str, Any]) -> str:
    """The line calling ``step``'s segment and binding the outputs someone reads to ``v<slot>``."""
    call = f"call_{step.index}"
    single = step.single_output and step.call is not None
    names[call] = step.call if single else step.fn
    if single:
        return f"{f'v{step.out_slots[0]}' if step.writes else '_'} = {call}({args})"
    if not step.writes:
        return f"{call}({args})"
    # Unpacked by position: the callable returns exactly one value per output.
    targets = ", ".join(f"v{s}" if s >= 0 else "_" for s in step.out_slots)
    return f"{targets}{',' if len(step.out_slots) == 1 else ''} = {call}({args})"


def _function(
    header: str, num_inputs: int, prologue: list[str], body: list[str], raised: str, outputs: list[str]
) -> str:
    """A generated function: unpack the inputs, evaluate sizes, run ``body`` under a handler that
    annotates the exception (``step``: the step that raised, -1 before the first), return ``outputs``."""
    lines = [header]
    if num_inputs:
        unpack = ", ".join(f"v{i}" for i in range(num_inputs))
        lines.append(f"    {unpack}{',' if num_inputs == 1 else ''} = args")
    lines += prologue
    lines += ["    step = -1", "    try:"]
    lines += [f"        {line}" for line in body or ["pass"]]
    lines += ["    except BaseException as e:", f"        {raised}", "        raise",
              f"    return ({', '.join(outputs)}{',' if len(outputs) == 1 else ''})"]
    return "\n".join(lines) + "\n"


def _outputs(program: Program, sizes: _Sizes, names: dict[str, Any]) -> list[str]:
    outputs = []
    for i, r in enumerate(program.outputs):
        if isinstance(r, Ref):
            outputs.append(sizes(r.size) if r.size is not None else f"v{r.slot}")
        else:
            names[f"const_{i}"] = r
            outputs.append(f"const_{i}")
    return outputs


def _exec(name: str, stage: str, source: str, names: dict[str, Any], raised: Callable[..., None]) -> Any:
    scope: dict[str, Any] = {**names, "raised": raised}
    exec(compile(source, f"<ppcompile {name} {stage}>", "exec"), scope)
    fn = scope[name]
    fn.source = source
    return fn


# ----------------------------------------------------------------------------------- live path
def live_forward_source(
    program: Program, layouts: LiveLayouts | None = None
) -> tuple[str, dict[str, Any]]:
    """The generated source of ``program``'s live forward and the globals it reads; with ``layouts``,
    the values it lists are checked (``L``: their expected layouts for this call)."""
    names: dict[str, Any] = {}
    sizes = _Sizes("z", "env", names)
    checks: dict[int, int] = {}  # slot -> index in layouts.checked
    if layouts is not None:
        checks = {c.slot: k for k, c in enumerate(layouts.checked)}
        names["layouts"] = layouts
        names["Tensor"] = torch.Tensor

    def check(slot: int) -> list[str]:
        k = checks.get(slot)
        if k is None:
            return []
        v = f"v{slot}"
        layout = f"({v}.shape, {v}.stride(), {v}.dtype, {v}.device)"
        return [f"if not isinstance({v}, Tensor) or {layout} != L[{k}]:",
                f"    {v} = layouts.repair({k}, {v}, L[{k}])"]

    body = [line for slot in range(program.num_inputs) for line in check(slot)]
    for step in program.steps:
        args = ", ".join(sizes(r.size) if r.size is not None else f"v{r.slot}" for r in step.args)
        body += [f"step = {step.index}", _call_segment(step, args, names)]
        for _, s in step.writes:
            body += check(s)
    outputs = _outputs(program, sizes, names)
    prologue = sizes.prologue() + (["    L = layouts(env)"] if checks else [])
    source = _function("def live_forward(args, env):", program.num_inputs, prologue, body,
                       "raised(e, step)", outputs)
    return source, names


def _annotate(stage: str, segments: Sequence[str], e: BaseException, step: int) -> None:
    """Adds a note naming the failed segment to the exception in flight (its type is unchanged)."""
    where = f"segment {segments[step]}" if step >= 0 else "setup"
    add_note(e, f"pp_breakable: raised in {where} of {stage}, run eagerly")


def make_live_forward(
    program: Program, stage: str = "stage", checked: Sequence[CheckedValue] = ()
) -> LiveForward:
    """Compiles ``program``'s live forward. ``checked``: values to check before graph segments read
    them (:class:`LiveLayouts`, for segments compiled without Inductor's input asserts). A failure gets
    a note naming the segment ("setup" before the first)."""
    source, names = live_forward_source(program, LiveLayouts(stage, checked) if checked else None)
    segments = tuple(st.segment.name for st in program.steps)
    fn: LiveForward = _exec("live_forward", stage, source, names,
                            functools.partial(_annotate, stage, segments))
    return fn


# ----------------------------------------------------------------------------------- graph path
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


def graph_forward_source(
    program: Program, binds_inputs: bool, pass_args: bool, copies: CopyFunctions | None = None,
    fused: bool = False,
) -> tuple[str, dict[str, Any]]:
    """The generated source of ``program``'s graph path for one bucket and the globals it reads.

    ``binds_inputs``: the executor's replays read what they captured (a CUDA graph), so their outputs
    stay in ``static``; else each replay returns its outputs, written into ``static`` (a per-call copy of
    the bucket's table). ``pass_args``: hand each replay its arguments (a non-binding executor, or the
    debug address check). The steps of a graph-path call: copy the live inputs into their static buffers
    (zeroing the padding rows), replay graph segments, narrow what breaks and callers read to the live
    size, run breaks on live tensors and copy what graphs read into static bridges; last, copy each
    input a graph wrote in place back into the caller's tensor, and with an ``output_ring``, copy each
    output in static memory into this call's ring slot (``ring``: a ``FencedSlot``, claimed first: it
    waits for the sends still reading it). ``copies``: the functions that copy inputs and bridges
    (default :data:`COPY_FUNCTIONS`; a profiler wraps them). ``fused``: each copy point
    (``Program.copy_points``) fills its ``fused`` buffers with one call of its copier
    (``copiers[point.index]``), e.g. ``copiers[0]((v0, v1), (n0, n0), (b0, b0))``, instead of a copy and a
    zeroing per tensor; its other buffers are filled by torch ops.
    """
    names: dict[str, Any] = {"narrow_to": static_buffers.narrow_to, **(copies or COPY_FUNCTIONS)}
    live, bucket = _Sizes("n", "env_n", names), _Sizes("b", "env_b", names)
    body: list[str] = []
    # Unwrapped copy functions (no profiler): one-dim copies are written inline, not called.
    inline = all(names[k] is f for k, f in COPY_FUNCTIONS.items())
    row_views: dict[int, tuple[int, str, str]] = {}  # slot -> (token dim, live size, bucket size)

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
            if inline:  # static_buffers.copy_rows on views made once per call (see VIEW_CACHE)
                if slot not in row_views:
                    row_views[slot] = (d, n, b)
                body.extend([f"dst{slot}.copy_({src})", f"if {b} > {n}:", f"    pad{slot}.zero_()"])
            else:
                body.append(f"{kind}_rows({buf}, {src}, {d}, {n}, {b})")
        else:
            names[f"dims_{slot}"] = dims
            body.append(f"{kind}_in({buf}, {src}, dims_{slot}, env_n, env_b)")

    def view(slot: int) -> None:
        """``v<slot>``: the static value narrowed to the live size along its token dims."""
        dims = dims_of(slot)
        if not dims:
            body.append(f"v{slot} = static[{slot}]")
        elif len(dims) == 1:
            (d, size), = dims
            n = live(size)
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
            body.append(f"copiers[{point.index}](({srcs},), ({ns},), ({bs},))")
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
                args += "," if len(step.args) == 1 else ""
            if binds_inputs:
                body.append(f"replay(({step.index}, b), ({args}))")
            else:
                body.append(f"o = replay(({step.index}, b), ({args}))")
                body += [f"static[{s}] = o[{i}]" for i, s in step.writes]
            for s in (*step.live_views, *step.writes_buffers):
                view(s)  # a static value the graph wrote in place: read back from its buffer
            body += [f"v{s} = static[{s}]" for s in step.live_values]
        else:
            args = ", ".join(live(r.size) if r.size is not None else f"v{r.slot}" for r in step.args)
            body.append(_call_segment(step, args, names))
            if step.copies is not None:
                fill_point(step.copies)
    body[:0] = _row_views(row_views)
    body += [f"args[{s}].copy_(v{s})" for s in program.written_inputs]  # the caller's tensor, as eager
    ring = program.output_ring
    if ring is not None:
        body.append("ring_buffers = ring.claim()")  # waits for the sends still reading this slot
        for j, s in enumerate(ring.slots):  # ring_buffers[j] holds slot s
            names[f"ring_layout_{j}"] = ring.layouts[j]
            body.append(f"v{s} = copy_out(ring_buffers[{j}], v{s}, ring_layout_{j}, env_n)")
    outputs = _outputs(program, live, names)
    header = "def graph_forward(args, static, env_n, env_b, replay, n, b, copiers, ring, views=None):"
    source = _function(header,
                       program.num_inputs, live.prologue() + bucket.prologue(), body, "raised(e, step, n, b)",
                       outputs)
    return source, names


VIEW_CACHE = 64
"""Per bucket table, how many sets of copy views (one per distinct set of sizes) a graph path keeps."""


def _row_views(row_views: Mapping[int, tuple[int, str, str]]) -> list[str]:
    """Lines binding ``dst<slot>`` (the live rows) and ``pad<slot>`` (the padding rows up to the bucket)
    of each static buffer filled along one token dim, made once per call, or taken from ``views`` (the
    bucket table's cache, keyed by the sizes: the table's buffers never change) when these sizes came
    before: only ``copy_`` and ``zero_`` are left per copy. The views are internal: only these copies
    write through them, and nothing outside the call sees them."""
    if not row_views:
        return []
    sizes = sorted({x for _, n, b in row_views.values() for x in (n, b)})
    targets = ", ".join(f"dst{s}, pad{s}" for s in row_views)
    made = ", ".join(f"static[{s}][{_leading(d, f':{n}')}], static[{s}][{_leading(d, f'{n}:{b}')}]"
                     for s, (d, n, b) in row_views.items())
    return [f"key = ({', '.join(sizes)},)",
            "D = None if views is None else views.get(key)",
            "if D is None:",
            f"    D = ({made},)",
            "    if views is not None:",
            f"        if len(views) >= {VIEW_CACHE}:",
            "            views.clear()",
            "        views[key] = D",
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


def make_graph_forward(program: Program, stage: str, binds_inputs: bool, pass_args: bool,
                       copies: CopyFunctions | None = None, fused: bool = False) -> GraphForward:
    """Compiles ``program``'s graph path (:func:`graph_forward_source`): called as
    ``fn(args, static, env_n, env_b, executor.replay, n, b, copiers, ring)``
    (``copiers``: one per ``Program.copy_points`` entry when ``fused``, else unused; ``ring``: this call's
    output ring slot, a ``fences.FencedSlot``, or None without a ring), it returns the stage's
    outputs at the live size (views into static memory)."""
    source, names = graph_forward_source(program, binds_inputs, pass_args, copies, fused)
    segments = tuple(st.segment.name for st in program.steps)
    fn: GraphForward = _exec("graph_forward", stage, source, names,
                             functools.partial(_annotate_graph_path, stage, segments))
    return fn

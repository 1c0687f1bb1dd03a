"""Pass ``find_declared_regions``: which nodes belong to a region the user declared.

**Token-local modules.**
``ppcompile.token_local(module or class)`` vouches that a module's output rows depend only on the same
input rows (a sparse-MoE block). Its ops are found by the module stack Dynamo records on every node
(``meta["nn_module_stack"]``: path -> class, outermost first) for declared classes, and by the
annotation the declared instance's wrapped ``forward`` adds (``meta["custom"]["pp_token_local"]``).
Each contiguous run of such nodes is one region, named by the declared module's path and class, and
recorded as ``meta["pp_token_local"]``. ``check_padding_safety`` then skips the per-op rules inside a
region; ``split_at_breaks`` never cuts one (its inner values, tokens sorted by expert, are not
token-major, so a live-size view of them would be wrong): a region holding any break is one break.

Before (an MoE block ``L['self'].moe`` of class ``Moe``, declared)::

    linear = torch._C._nn.linear(l_x_, l_w_)               # stack: ...
    sort = torch.sort(router_logits, 0)                     # stack: L['self'].moe (Moe)
    scatter = torch.zeros_like(linear).index_add(0, ...)   # stack: L['self'].moe (Moe)
    add = scatter + linear                                  # stack: ...

After (same code)::

    sort.meta["pp_token_local"] == scatter.meta["pp_token_local"] == "moe (mymodel.Moe)"
    ctx.token_local_regions == ("moe (mymodel.Moe)",)

Library modules (``regions.LIBRARY_MODULES``: HF's state-space mixers and sparse-MoE blocks) are
library regions, ``meta["pp_eager_region"]`` with a ``library region:`` label, and hold any region
declared inside them, except that a sparse-MoE block declared token-local stays token-local.

**Eager regions.** Nodes whose stack trace passes through a function declared with
``ppcompile.eager_region`` get ``meta["pp_eager_region"]`` (the function's name); ``split_at_breaks``
makes each run of them one break. Before/after, with ``chunked_scan`` declared::

    pad = torch.nn.functional.pad(x, (0, 0, 0, p))     # stack: ... in chunked_scan
    out = linear(...)                                   # stack: ... in forward

    pad.meta["pp_eager_region"] == "mymodel.chunked_scan";  "pp_eager_region" not in out.meta
"""

from __future__ import annotations

import logging
import re
from collections.abc import Set
from typing import Any

import torch

from ppcompile.analysis.node_facts import EAGER_REGION, TOKEN_LOCAL
from ppcompile.passes.context import PassContext, PassResult
from ppcompile.tracing.regions import (
    ANNOTATION_KEY,
    LIBRARY_MODULES,
    LIBRARY_MOE_BLOCKS,
    LIBRARY_PREFIX,
    class_label,
    declared_classes,
    declared_functions,
)

__all__ = ["find_declared_regions"]

log = logging.getLogger(__name__)

_MOE_SUFFIXES = tuple(f"({label})" for label in LIBRARY_MOE_BLOCKS)
_ROOT = re.compile(r"^L\['[^']*'\]\.?")  # Dynamo's source of the compiled module itself
_FRAME = re.compile(r'File "([^"]+)", line \d+, in (\S+)')


def _readable(path: str) -> str:
    """``L['self'].layers[0].mlp`` -> ``layers.0.mlp``; Dynamo's ``.forward.__self__`` hops dropped."""
    path = _ROOT.sub("", path).replace(".forward.__self__", "")
    return re.sub(r"\[(\d+)\]", r".\1", path).replace("['", ".").replace("']", "") or "(stage)"


def _region_of(stack: dict[str, Any] | None, classes: Set[str], annotated: str | None) -> str | None:
    """The name of the region a node of module ``stack`` lies in: the outermost module of one of
    ``classes`` on it (or an instance declared token-local, whose label the node carries: ``annotated``)."""
    for entry in (stack or {}).values():
        path, cls = entry if isinstance(entry, tuple) and len(entry) == 2 else (str(entry), None)
        label = class_label(cls) if isinstance(cls, type) else str(cls)  # some torch releases: a name
        if label in classes or label == annotated:
            return f"{_readable(str(path))} ({label})"
    if annotated is not None:
        return f"({annotated})"  # no module stack recorded: the label alone
    return None


def _regions_of(
    node: torch.fx.Node, classes: Set[str], seen: dict[tuple[int, str | None], tuple[str | None, str | None]],
) -> tuple[str | None, str | None]:
    """The library module and the declared region ``node`` lies in, each None if none. Worked out once
    per module stack and annotation (``seen``, for one graph): the copies of a stamped layer's ops
    share stacks (``copied_calls.restacked``)."""
    stack = node.meta.get("nn_module_stack")
    annotated = (node.meta.get("custom") or {}).get(ANNOTATION_KEY)  # a label: regions.token_local's
    key = (id(stack), annotated)
    found = seen.get(key)
    if found is None:
        library, declared = _region_of(stack, LIBRARY_MODULES, None), _region_of(stack, classes, annotated)
        if declared is not None and library is not None and library.endswith(_MOE_SUFFIXES):
            library = None  # a sparse-MoE block declared token-local stays in graphs, as declared
        found = seen[key] = (library, declared)
    return found


def _eager_region_of(node: torch.fx.Node, functions: dict[tuple[str, str], str]) -> str | None:
    """The declared function ``node`` was traced inside (the outermost on its stack), if any."""
    for file, name in _FRAME.findall(node.meta.get("stack_trace") or ""):
        label = functions.get((file, name))
        if label is not None:
            return label
    return None


def find_declared_regions(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Marks the nodes of declared token-local modules ``meta["pp_token_local"]`` (fills
    ``ctx.token_local_regions``) and those of declared eager functions ``meta["pp_eager_region"]``."""
    classes = set(declared_classes().values())
    functions = declared_functions()
    names: dict[str, None] = {}
    seen: dict[tuple[int, str | None], tuple[str | None, str | None]] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "get_attr"):
            continue
        library, name = _regions_of(node, classes, seen)
        # A library module holds any region declared inside it (one region per module instance).
        eager = LIBRARY_PREFIX + library if library is not None else (
            _eager_region_of(node, functions) if functions else None)
        if eager is not None:
            EAGER_REGION.set(node, eager)
            continue
        if name is not None:
            TOKEN_LOCAL.set(node, name)
            names[name] = None
    ctx.token_local_regions = tuple(names)
    if names:
        log.info("%s: token-local regions %s", ctx.graph_name, ", ".join(names))
    return PassResult(gm, modified=False)

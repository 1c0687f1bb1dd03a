"""Trace each repeated layer of a stage once: ``ppcompile.trace_layers_once(stage)``.

Dynamo traces a stage op by op, so its trace grows with the layer count. By default
``trace_layers_once`` stamps each group of alike layers out from the first one Dynamo traces
(``ppcompile.tracing.layer_stamps``): per-layer constants passed to custom ops (global layer ids) do not stop
it. With ``stamp=False`` it wraps the repeated modules of the stage (its decoder layers, or the parts of
them that are alike in every layer) as ``torch.compiler.nested_compile_region`` calls instead: Dynamo
traces the first call and stamps its subgraph out for the others, and the backend's first pass inlines
every call again. Either way the split, the buckets and the results are those of a flat trace, and the
model's code is not changed: a stamped layer's class (and its ``nn.ModuleList``'s) becomes a subclass
of its own, a wrapped module gets an instance ``forward``.

What decides where the regions go with ``stamp=False`` (the traps a region must avoid):

- **Per-layer constants.** Before torch stamps a region's subgraph out for another layer it re-checks
  the guards of the first trace, a Python constant read inside (a global layer id handed to an attention
  op) included: the result is never wrong, but every layer then fails that check against each earlier
  trace and is traced again, which costs more than a flat trace. So a module is a region only if its
  whole subtree holds the same non-tensor state in every layer (same classes, same attribute values,
  same parameter shapes); a module that differs is traced flat and its children are considered one by
  one. The plan names the attribute that kept each module flat.
- **Aliasing.** A region may not take two views of one tensor (``q`` and ``k`` split from one
  projection) nor return a view of an input or two views of one tensor (Dynamo raises). Each tensor a
  region takes and returns passes through ``ppcompile::region_copy``, and each input is written back
  from its copy afterwards (``ppcompile::region_write_back``: the region may have written it in place).
  The backend's ``inline_nested_regions`` pass removes both, so the stage graph aliases and writes in
  place exactly as the model does. With another backend they stay: the same results, more copies.
  Outside ``torch.compile`` the wrapped modules run their own ``forward`` directly.
- **Nothing to share.** Built-in one-op modules (``nn.Linear``, ``nn.LayerNorm``, ...) and modules that
  occur once are not wrapped: a region costs more to stamp out than one op costs to trace.
- **Too small to pay.** A call of a region costs Dynamo about what tracing a few small modules does, so
  a module whose subtree holds fewer than ``min_region_modules`` modules with parameters of their own
  (default 4: a norm holds 1, a SwiGLU MLP 2 or 3, an MoE block or a whole layer more) is traced flat;
  the plan says so.
- **Regions inside regions.** Repeated modules inside a region (an MoE block's experts) are left to it:
  its one trace covers them. Wrapped too, each layer's inner modules would route through a wrapper of
  their own, whose closure torch guards: the outer region would be traced again for every layer.

Under ``torch.compile(dynamic=True)`` the wrapped modules trace flat: torch 2.13's Dynamo fails inside
regions when every dim is dynamic. Arguments that differ per call (a constant passed to ``forward``)
make torch trace the region again for that call, which is correct and only slower; the compile record
counts the calls and the distinct traces of every region (``region_traces``). On a torch whose
``nested_compile_region`` does not reuse traces (2.11), every call is traced: no faster, still correct.
"""

from __future__ import annotations

import dataclasses
import logging
import types
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ppcompile.torch_internals import every_dim_dynamic, nested_compile_region
from ppcompile.tracing.layer_stamps import install_stamps
from ppcompile.tracing.marker_ops import region_copy, region_write_back

__all__ = ["DEFAULT_MIN_REGION_MODULES", "LayerRegionPlan", "RegionSite", "layer_region_plans", "region_copy",
           "trace_layers_once"]

log = logging.getLogger(__name__)

_MODULE_INTERNALS = frozenset({
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_backward_pre_hooks",
    "_backward_hooks", "_is_full_backward_hook", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
})
_HOOKS = ("_forward_hooks", "_forward_pre_hooks")
DEFAULT_MIN_REGION_MODULES = 4
_PLANS: weakref.WeakKeyDictionary[nn.Module, tuple[LayerRegionPlan, ...]] = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class RegionSite:
    """One module path of a layer group that became a region: ``path`` relative to each layer (``""``:
    the whole layer), the modules' class, and how many layers share it."""

    path: str
    module_class: str
    modules: int


@dataclasses.dataclass(frozen=True)
class LayerRegionPlan:
    """What ``trace_layers_once`` did to one group of alike layers: the regions it made and the modules
    it left to a flat trace, each with the reason (path relative to the layer -> why)."""

    layers: tuple[str, ...]  # the layers' names in the stage
    layer_class: str
    regions: tuple[RegionSite, ...]
    flat: tuple[tuple[str, str], ...]
    stamped: bool = False  # every layer checked against the first one called and traced as one op

    def describe(self) -> str:
        where = f"{len(self.layers)} x {self.layer_class} ({self.layers[0]} .. {self.layers[-1]})"
        lines = [f"trace_layers_once: {where}"]
        if self.stamped:
            lines.append("  stamped: the first layer called is traced, each other one checked against it "
                         "and traced as one op (a layer that fails its check is traced flat and logged)")
        lines += [f"  region {site.path or '(whole layer)'}: {site.module_class} x {site.modules}"
                  for site in self.regions]
        lines += [f"  traced flat {path or '(whole layer)'}: {why}" for path, why in self.flat]
        return "\n".join(lines)


def trace_layers_once(
    stage: nn.Module, *, stamp: bool = True, min_region_modules: int = DEFAULT_MIN_REGION_MODULES
) -> nn.Module:
    """Makes Dynamo trace each distinct repeated layer of ``stage`` once (see the module docstring).

    Apply before ``torch.compile``; changes ``stage`` in place (the classes of stamped layers and of
    their ``nn.ModuleList``, a stamped layer's handle in ``_ppcompile_stamp``; a region's instance
    ``forward``) and returns it. A second call does nothing. Logs
    the plan at INFO; :func:`layer_region_plans` returns it.
    ``stamp``: stamp whole layers out (``ppcompile.tracing.layer_stamps``); False makes regions instead.
    ``min_region_modules`` (regions only): the fewest modules with parameters of their own a region's
    subtree holds.
    """
    if not isinstance(stage, nn.Module):
        raise TypeError(f"trace_layers_once: expected an nn.Module, got {type(stage).__name__}")
    if isinstance(min_region_modules, bool) or not isinstance(min_region_modules, int) \
            or min_region_modules < 1:
        raise ValueError(f"trace_layers_once: min_region_modules must be an int >= 1, got "
                         f"{min_region_modules!r}")
    if not isinstance(stamp, bool):
        raise TypeError(f"trace_layers_once: stamp must be True or False, got {stamp!r}")
    if stage in _PLANS:
        return stage
    if not stamp and getattr(torch.compiler, "nested_compile_region", None) is None:
        log.warning("trace_layers_once: this torch has no torch.compiler.nested_compile_region; "
                    "the stage is traced flat")
        _PLANS[stage] = ()
        return stage
    plans: list[LayerRegionPlan] = []
    regions: list[str] = []  # the wrapped modules' names
    inside: dict[str, int] = {}  # region class -> groups inside its regions, left to them
    for names, modules in _layer_groups(stage):
        if any(names[0].startswith(r + ".") for r in regions):
            inside[type(modules[0]).__name__] = inside.get(type(modules[0]).__name__, 0) + 1
            continue
        patched = next((n for n, m in zip(names, modules) if "forward" in vars(m)), None) if stamp else None
        why = None if patched is None else (  # stamping calls the class's forward: it would bypass this one
            f"{patched} has a forward of its own (an instance attribute) that stamping would bypass")
        if stamp and why is None:
            why = install_stamps(names, modules, stage.get_submodule(names[0].rpartition(".")[0]))
        if why is not None:
            plan = LayerRegionPlan(tuple(names), _class_name(type(modules[0])), (), (("", why),))
        elif stamp:
            plan = LayerRegionPlan(tuple(names), _class_name(type(modules[0])), (), (), stamped=True)
        else:
            plan = _plan_group(names, modules, min_region_modules)
        plans.append(plan)
        regions += list(plan.layers) if plan.stamped else [
            f"{layer}.{site.path}" if site.path else layer for site in plan.regions for layer in plan.layers]
        log.info("%s", plan.describe())
    for cls, count in inside.items():
        log.info("trace_layers_once: %d group(s) of repeated %s modules lie inside regions; each region's "
                 "one trace covers them", count, cls)
    if not plans:
        log.info("trace_layers_once: %s has no repeated layers (a list of two or more modules of one "
                 "class); it is traced flat", type(stage).__name__)
    _PLANS[stage] = tuple(plans)
    return stage


def layer_region_plans(stage: nn.Module) -> tuple[LayerRegionPlan, ...] | None:
    """The plans ``trace_layers_once`` made for ``stage``, or None if it was not applied."""
    return _PLANS.get(stage)


# ------------------------------------------------------------------------------------------ planning
def _layer_groups(stage: nn.Module) -> list[tuple[list[str], list[nn.Module]]]:
    """Each list-like container's modules, grouped by class, where a class occurs at least twice."""
    groups: list[tuple[list[str], list[nn.Module]]] = []
    for name, container in stage.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        by_class: dict[type, tuple[list[str], list[nn.Module]]] = {}
        for child_name, child in container.named_children():
            names, modules = by_class.setdefault(type(child), ([], []))
            names.append(f"{name}.{child_name}" if name else child_name)
            modules.append(child)
        groups += [group for group in by_class.values() if len(group[1]) > 1 and _worth_a_region(group[1][0])]
    return groups


def _has_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward and not isinstance(module, nn.ModuleList)


def _plan_group(names: list[str], modules: list[nn.Module], min_modules: int) -> LayerRegionPlan:
    regions: list[RegionSite] = []
    flat: list[tuple[str, str]] = []
    _place(names, modules, "", regions, flat, min_modules)
    return LayerRegionPlan(tuple(names), _class_name(type(modules[0])), tuple(regions), tuple(flat))


def _place(names: Sequence[str], modules: Sequence[nn.Module], path: str, regions: list[RegionSite],
           flat: list[tuple[str, str]], min_modules: int) -> None:
    """Makes ``modules`` (one class, one path in alike layers) a region, or leaves them flat and recurses."""
    difference = _first_difference(names, modules)
    if difference is None:
        if not _worth_a_region(modules[0]):
            return
        held = _modules_with_parameters(modules[0])
        if held < min_modules:
            flat.append((path, f"too small to pay for a region ({held} module(s) with parameters, "
                               f"min_region_modules={min_modules})"))
            return
        _wrap(modules, path)
        regions.append(RegionSite(path, _class_name(type(modules[0])), len(modules)))
        return
    flat.append((path, difference))
    for child_name in dict.fromkeys(n for m in modules for n in m._modules):
        kids: dict[type, tuple[list[str], list[nn.Module]]] = {}
        for name, module in zip(names, modules):
            kid = module._modules.get(child_name)
            if kid is not None:
                group = kids.setdefault(type(kid), ([], []))
                group[0].append(f"{name}.{child_name}")
                group[1].append(kid)
        for kid_names, kid_modules in kids.values():
            if len(kid_modules) > 1:
                _place(kid_names, kid_modules, f"{path}.{child_name}" if path else child_name, regions, flat,
                       min_modules)


def _modules_with_parameters(module: nn.Module) -> int:
    """How many modules of ``module``'s subtree (itself included) hold parameters of their own."""
    return sum(1 for m in module.modules() if next(m.parameters(recurse=False), None) is not None)


def _worth_a_region(module: nn.Module) -> bool:
    """Not a built-in one-op module, not a stateless one (an activation, another stage's placeholder)."""
    builtin_leaf = type(module).__module__.startswith("torch.nn.") and not module._modules
    stateful = any(True for _ in module.parameters()) or any(True for _ in module.buffers())
    return _has_forward(module) and stateful and not builtin_leaf


def _first_difference(names: Sequence[str], modules: Sequence[nn.Module]) -> str | None:
    """Why ``modules`` cannot share one trace (the first difference found), or None if they can."""
    reference = _state(modules[0])
    for name, module in zip(names[1:], modules[1:]):
        state = _state(module)
        if state.keys() != reference.keys():
            extra = sorted(set(state.keys()) ^ set(reference.keys()))[0]
            return f"'{extra}' is not in every layer ({names[0]} vs {name})"
        for key, value in reference.items():
            if not _same(value, state[key]):
                return (f"'{key}' differs between layers ({_short(value)} in {names[0]}, "
                        f"{_short(state[key])} in {name}): a per-layer constant makes torch trace the "
                        "region again for every layer")
    return None


def _state(module: nn.Module) -> dict[str, Any]:
    """The non-tensor state of ``module``'s subtree that a trace may bake in, by relative name."""
    state: dict[str, Any] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        state[f"{dot}(class)"] = type(sub)
        for key, value in vars(sub).items():
            if key not in _MODULE_INTERNALS:
                state[dot + key] = value
        for hooks in _HOOKS:
            if getattr(sub, hooks, None):
                state[dot + hooks] = tuple(getattr(sub, hooks).values())
        for key, tensor in [*sub._parameters.items(), *sub._buffers.items()]:
            if tensor is not None:
                state[dot + key] = ("tensor", tuple(tensor.shape), tensor.dtype, tensor.device,
                                    tensor.requires_grad)
    return state


_PLAIN = (int, float, complex, str, bool, bytes, type(None), torch.dtype, torch.device, type)


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b) or isinstance(a, torch.Tensor):
        return False  # plain tensor attributes are compared by identity: a per-layer cache differs
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, _PLAIN) or dataclasses.is_dataclass(a) or type(a).__eq__ is not object.__eq__:
        try:
            return bool(a == b)
        except Exception:  # an __eq__ that cannot compare: treat as different
            return False
    return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# ------------------------------------------------------------------------------------------ wrapping
def _fresh(value: Any) -> Any:
    """``value`` with each tensor (at any depth of tuples, named tuples, lists and dicts) replaced by its
    region copy; other containers are returned as they are. Written out, not with ``torch.utils._pytree``:
    Dynamo traces this on every call, and a pytree walk costs it more than the region saves."""
    if isinstance(value, torch.Tensor):
        return region_copy(value)
    if type(value) in (tuple, list):
        return type(value)(_fresh(v) for v in value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_fresh(v) for v in value))
    if type(value) is dict:
        return {k: _fresh(v) for k, v in value.items()}
    return value


def _wrap(modules: Iterable[nn.Module], path: str) -> None:
    """Routes each module's ``forward`` through one region per site (its own code object: torch keys
    reuse by the region function's code, and sites must not share entries)."""
    modules = list(modules)
    forward = type(modules[0]).forward

    def body(module: nn.Module, layout: str, *leaves: Any) -> Any:
        args, kwargs = _unflatten(layout, leaves)
        return _fresh(forward(module, *args, **kwargs))

    site = "".join(c if c.isalnum() else "_" for c in f"{type(modules[0]).__name__}_{path}")
    body.__code__ = body.__code__.replace(co_name=f"ppcompile_region_{site}",
                                          co_qualname=f"ppcompile_region_{site}")
    region = nested_compile_region(body, max_traces=len(modules) + 1)

    def through_region(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        flat = _flatten(args, kwargs) if torch.compiler.is_compiling() and not every_dim_dynamic() else None
        if flat is None:  # eager, dynamic=True, or an argument nested deeper than it flattens: no region
            return forward(self, *args, **kwargs)
        layout, leaves = flat
        copies = _fresh(leaves)
        out = region(self, layout, *copies)
        for leaf, copy in zip(leaves, copies):
            if isinstance(leaf, torch.Tensor):
                region_write_back(leaf, copy)
        return out

    for module in modules:  # a bound method: the region's module argument keeps the module's own source
        module.forward = types.MethodType(through_region, module)


# The region takes its arguments flat (torch fingerprints a call of flat tensors and constants cheaply,
# and flattens anything else through a traced pytree walk on every call), with their layout as one
# string: ``"x,(2;name=x"`` is ``f(a, (b, c), name=d)``: "x" one leaf, "(n" / "[n" a tuple / list of n.
def _flatten(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, list[Any]] | None:
    leaves: list[Any] = []
    tokens: list[str] = []
    for value in [*args, *kwargs.values()]:
        if isinstance(value, (tuple, list)):
            if any(isinstance(v, (tuple, list, dict)) for v in value) or type(value) not in (tuple, list):
                return None
            tokens.append(("(" if isinstance(value, tuple) else "[") + str(len(value)))
            leaves.extend(value)
        elif isinstance(value, dict):
            return None
        else:
            tokens.append("x")
            leaves.append(value)
    names = [f"{name}={token}" for name, token in zip(kwargs, tokens[len(args):])]
    return ",".join(tokens[:len(args)]) + ";" + ",".join(names), leaves


def _unflatten(layout: str, leaves: tuple[Any, ...]) -> tuple[list[Any], dict[str, Any]]:
    positional, named = layout.split(";")
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    at = 0
    for entry in [*positional.split(","), *named.split(",")]:
        if not entry:
            continue
        name, _, token = entry.rpartition("=")
        if token == "x":
            value, at = leaves[at], at + 1
        else:
            count = int(token[1:])
            items = leaves[at:at + count]
            value, at = (tuple(items) if token[0] == "(" else list(items)), at + count
        if name:
            kwargs[name] = value
        else:
            args.append(value)
    return args, kwargs

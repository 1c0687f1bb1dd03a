"""A tensor-parallel stage on 2 gloo ranks: collectives stay in graph segments, the ranks decide alike.

Each test spawns two ranks (``spawn_ranks``: a hang is a ``TimeoutError`` naming the rank, never a stuck
run) that compile the toy TP stage of ``tp_toy.py`` and run it over token counts 1, a bucket, a bucket
+ 1 and above the cap; the parent compares every answer with the single-process model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from tp_toy import CUSTOM_OPS, FAIL_AT, STYLES, ToyTP, attention_context

import ppcompile
from ppcompile.pipeline import spawn_ranks
from ppcompile.runtime.group_agreement import GroupDivergenceError

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

LAYERS = (3, 4)  # global layer ids: two attention breaks
COUNTS = (1, 8, 9, 16, 17, 40)  # 1, a bucket, a bucket + 1, the cap, above the cap
SIZES = [8, 16]


def _inputs(n: int) -> torch.Tensor:
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(n))


def _reference() -> dict[int, torch.Tensor]:
    model = ToyTP(LAYERS)
    out = {}
    with torch.inference_mode():
        for n in COUNTS:
            with attention_context(n, LAYERS):
                out[n] = model(_inputs(n))
    return out


ALL_BUT_ALL_REDUCE = ("all_gather", "broadcast", "all_gather_into_tensor", "all_gather_object", "barrier",
                      "reduce_scatter_tensor", "gather", "scatter")


@contextlib.contextmanager
def _counted_collectives() -> Iterator[dict[str, int]]:
    """Counts the calls of ``torch.distributed``'s collectives but ``all_reduce``, which the model calls:
    Dynamo guards on that function, so wrapping it would recompile the stage (the model's collectives
    run as traced ``_c10d_functional`` ops or custom ops, which do not pass here)."""
    counts = {"calls": 0}
    saved = {name: getattr(dist, name) for name in ALL_BUT_ALL_REDUCE}

    def counting(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts["calls"] += 1
            return fn(*args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(dist, name, counting(fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _run(model: torch.nn.Module, options: dict[str, Any], counts: tuple[int, ...] = COUNTS,
         shift: int = 0) -> dict[str, Any]:
    """Compiles ``model`` and runs it at ``counts`` (this rank's counts + ``shift``)."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="pp_breakable", options=options)
    outs: dict[int, torch.Tensor] = {}
    paths = []
    with torch.inference_mode():
        for n in counts:
            replays, eager = ppcompile.counters.replays, ppcompile.counters.eager_runs
            x = _inputs(n + shift)
            torch._dynamo.mark_dynamic(x, 0)
            with attention_context(n + shift, LAYERS):
                outs[n] = compiled(x).clone()
            paths.append("graph" if ppcompile.counters.replays > replays else
                         "eager" if ppcompile.counters.eager_runs > eager else "other")
    runtimes = [rt for rt in ppcompile.runtimes_of(compiled) if rt.token_symbol is not None]
    return {"outs": outs, "paths": paths, "runtimes": runtimes, "compiled": compiled}


def _modes_worker(rank: int, world: int, style: str) -> dict[str, Any]:
    """Every graph mode with one all-reduce style; per mode, outputs, paths and the breaks."""
    group = dist.new_group(list(range(world)))
    results = {}
    for mode in ("emulate", "eager", "none", "auto"):
        options: dict[str, Any] = {"graph_mode": mode, "capture_sizes": SIZES}
        if style.startswith("custom"):
            options |= {"collective_ops": list(CUSTOM_OPS), "tp_group": group}
        model = ToyTP(LAYERS, style=style, size=world, rank=rank, group=group)
        with _counted_collectives() as counted:
            run = _run(model, options)  # 1 token: a static graph; then the symbolic one captures
        (runtime,) = run["runtimes"]
        results[mode] = {
            "outs": run["outs"], "paths": run["paths"],
            "kinds": [s.kind for s in runtime.segments],
            "group_size": runtime.agreement.size,
            "collectives": [c.op for c in runtime.compiled.collectives],
            "calls": counted["calls"],
            "agreement": runtime.agreement.collectives,
        }
    return results


@pytest.mark.parametrize("style", STYLES)
def test_tp2_all_reduce_stays_in_graphs_and_equals_eager(style: str) -> None:
    results = spawn_ranks(_modes_worker, 2, args=(style,), threads=1, timeout_s=240)
    want = _reference()
    for rank, by_mode in enumerate(results):
        for mode, got in by_mode.items():
            for n in COUNTS:
                where = f"rank {rank} {mode} n={n}"
                torch.testing.assert_close(got["outs"][n], want[n], atol=1e-5, rtol=0,
                                           msg=lambda m, where=where: f"{where}: {m}")
            # one break per layer (the attention); the all-reduces stay in graph segments
            assert got["kinds"].count("break") == len(LAYERS), (mode, got["kinds"])
            assert got["group_size"] == 2, mode
            assert got["collectives"], mode
    emulate = results[0]["emulate"]
    # 1 token: its padding guard (bucket 8); 8, 9, 16: graphs; 17, 40: above the cap
    assert emulate["paths"] == ["eager", "graph", "graph", "graph", "eager", "eager"], emulate["paths"]
    assert results[0]["none"]["paths"] == ["eager"] * len(COUNTS)
    for by_mode in results:
        # capture agrees with a few collectives, and they are every collective ppcompile called
        assert by_mode["emulate"]["agreement"] > 0
        assert by_mode["emulate"]["calls"] == by_mode["emulate"]["agreement"]
        # without graphs: the first call's check of token count and options, nothing more
        assert by_mode["none"]["calls"] == by_mode["none"]["agreement"] == 1


def _forward_calls_worker(rank: int, world: int) -> dict[str, int]:
    """Collectives ppcompile calls per forward once captured: none."""
    group = dist.new_group(list(range(world)))
    model = ToyTP(LAYERS, size=world, rank=rank, group=group)
    options = {"graph_mode": "emulate", "capture_sizes": SIZES}
    run = _run(model, options, counts=(9,))  # compiles and captures
    compiled, (runtime,) = run["compiled"], run["runtimes"]
    agreed = runtime.agreement.collectives
    with _counted_collectives() as counted, torch.inference_mode():
        for n in (9, 12, 5, 16, 3, 40, 10):
            x = _inputs(n)
            torch._dynamo.mark_dynamic(x, 0)
            with attention_context(n, LAYERS):
                compiled(x)
    return {"calls": counted["calls"], "replays": ppcompile.counters.replays, "agreed": agreed,
            "agreed_after": runtime.agreement.collectives}


def test_no_collective_per_forward_after_capture() -> None:
    for got in spawn_ranks(_forward_calls_worker, 2, threads=1, timeout_s=120):
        assert got["replays"] >= 6, got
        assert got["calls"] == 0, got
        assert got["agreed"] > 0 and got["agreed_after"] == got["agreed"], got


def _failure_worker(rank: int, world: int, capture: str) -> dict[str, Any]:
    """A capture that fails on rank 1 only, at bucket 16."""
    group = dist.new_group(list(range(world)))
    FAIL_AT.update(rank=1, rows=16)
    model = ToyTP(LAYERS, size=world, rank=rank, group=group, inject=True)
    options = {"graph_mode": "emulate", "capture_sizes": SIZES, "capture": capture,
               "token_local_ops": ["pptest::fails_on_one_rank"]}
    run = _run(model, options, counts=(12, 9, 5, 13, 8))
    (runtime,) = run["runtimes"]
    return {"outs": run["outs"], "paths": run["paths"], "fall_offs": runtime.fall_offs()}


@pytest.mark.parametrize("capture", ["all", "lazy"])
def test_a_capture_failure_on_one_rank_turns_graphs_off_on_every_rank(capture: str) -> None:
    results = spawn_ranks(_failure_worker, 2, args=(capture,), threads=1, timeout_s=120)
    full = ToyTP(LAYERS, inject=True)
    with torch.inference_mode():
        for got in results:
            for n, out in got["outs"].items():
                with attention_context(n, LAYERS):
                    torch.testing.assert_close(out, full(_inputs(n)), atol=1e-5, rtol=0)
    paths = [r["paths"] for r in results]
    assert paths[0] == paths[1], paths  # the ranks took the same path every forward
    if capture == "all":
        assert paths[0] == ["eager"] * 5  # graphs are off for the instance on both ranks
        assert all("capture failed" in r["fall_offs"] for r in results)
    else:
        assert paths[0] == ["eager", "eager", "graph", "eager", "graph"]  # bucket 16 eager, bucket 8 graphs
        assert all("bucket capture failed" in r["fall_offs"] for r in results)
    assert "injected capture failure" in str(results[1]["fall_offs"])
    assert "rank(s) [1]" in str(results[0]["fall_offs"])


DIVERGENT = {  # per case: the token count each call gives rank 0, and rank 1's difference from it
    "first call": [(10, 1)],
    "after capture, debug": [(9, 0), (12, 1), (16, 0)],
    "graph mode": [(10, 0)],
}


def _divergent_worker(rank: int, world: int, case: str) -> dict[str, Any]:
    """The ranks are called (or compiled) differently: every rank must raise, none may hang."""
    group = dist.new_group(list(range(world)))
    model = ToyTP(LAYERS, size=world, rank=rank, group=group)
    mode = "none" if case == "graph mode" and rank == 1 else "emulate"
    options = {"graph_mode": mode, "capture_sizes": SIZES, "debug": case.endswith("debug")}
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="pp_breakable", options=options)
    errors: dict[int, str] = {}
    outs: dict[int, torch.Tensor] = {}
    with torch.inference_mode():
        for i, (n, shift) in enumerate(DIVERGENT[case]):
            x = _inputs(n + shift * rank)
            torch._dynamo.mark_dynamic(x, 0)
            try:
                with attention_context(n + shift * rank, LAYERS):
                    outs[n] = compiled(x).clone()
            except GroupDivergenceError as e:
                errors[i] = str(e)
    return {"errors": errors, "outs": outs}


@pytest.mark.parametrize("case", sorted(DIVERGENT))
def test_ranks_called_or_compiled_differently_fail_clearly(case: str) -> None:
    results = spawn_ranks(_divergent_worker, 2, args=(case,), threads=1, timeout_s=120)
    wrong = [i for i, (_, shift) in enumerate(DIVERGENT[case]) if shift] or [0]
    want = _reference_at([n for n, _ in DIVERGENT[case]])
    for got in results:
        assert list(got["errors"]) == wrong, got["errors"]  # every rank raised at that call, no other
        assert all("disagree on the token count and options" in e for e in got["errors"].values())
        for n, out in got["outs"].items():  # the calls the ranks agreed on: served, equal to eager
            torch.testing.assert_close(out, want[n], atol=1e-5, rtol=0)
    if case == "after capture, debug":
        assert sorted(results[0]["outs"]) == [9, 16]  # usable after the error


def _reference_at(counts: list[int]) -> dict[int, torch.Tensor]:
    model = ToyTP(LAYERS)
    with torch.inference_mode():
        out = {}
        for n in counts:
            with attention_context(n, LAYERS):
                out[n] = model(_inputs(n))
        return out


def _undeclared_worker(rank: int, world: int) -> str:
    group = dist.new_group(list(range(world)))
    model = ToyTP(LAYERS, style="custom", size=world, rank=rank, group=group)
    try:  # the custom op is declared, but its group is not given
        _run(model, {"graph_mode": "emulate", "capture_sizes": SIZES, "collective_ops": list(CUSTOM_OPS)},
             counts=(9,))
    except Exception as e:
        return str(e)
    return ""


def test_declared_collective_ops_without_tp_group_fail_at_compile() -> None:
    for message in spawn_ranks(_undeclared_worker, 2, threads=1, timeout_s=120):
        assert "tp_group" in message and "pptest.tp_all_reduce" in message, message


def _warm_worker(rank: int, world: int, cache_dir: str, style: str) -> dict[str, Any]:
    """One process start of a TP stage under ``ppcompile.warm_compile`` (the rank keys each rank's file:
    the ranks' stages are alike in class and shapes). ``funcol_name``: the model holds the group's name."""
    import logging
    import os

    os.environ["PPCOMPILE_CACHE_DIR"] = cache_dir
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ppcompile.backends.warm_start").addHandler(handler)
    group = dist.new_group(list(range(world)))
    options: dict[str, Any] = {"graph_mode": "emulate", "capture_sizes": SIZES}
    if style.startswith("custom"):
        options |= {"collective_ops": list(CUSTOM_OPS), "tp_group": group}
    held = group.group_name if style == "funcol_name" else group
    model = ToyTP(LAYERS, style=style.removesuffix("_name"), size=world, rank=rank, group=held)
    warm = ppcompile.warm_compile(model, options)
    outs, paths = {}, []
    with torch.inference_mode():
        for n in COUNTS:
            replays = ppcompile.counters.replays
            x = _inputs(n)
            ppcompile.mark_token_dynamic(x)
            with attention_context(n, LAYERS):
                outs[n] = warm(x).clone()
            paths.append("graph" if ppcompile.counters.replays > replays else "eager")
    (runtime,) = [rt for rt in warm.runtimes() if rt.token_symbol is not None]
    return {"outs": outs, "paths": paths, "loaded": warm.loaded, "compiled": warm.compiled,
            "fallback": warm.fallback_reason, "times": sorted(runtime.compiled.record.compile_times),
            "group_size": runtime.agreement.size, "agreed": runtime.agreement.collectives,
            "warnings": warnings}


@pytest.mark.parametrize("style", ["funcol_name", "custom", "funcol"])
def test_a_tp_stage_restarts_warm_on_every_rank(style: str, tmp_path: Any) -> None:
    """The second start of both ranks serves the stored lowered stage: same answers, same paths, and
    the ranks still agree at capture. A model that holds the process group itself is stored only where
    Dynamo rebuilds its guard on the object in another process (torch 2.11 does, 2.13 does not); where it
    is not, every start compiles and says why."""
    want = _reference()
    starts = [spawn_ranks(_warm_worker, 2, args=(str(tmp_path), style), threads=1, timeout_s=240)
              for _ in range(2)]
    for start, results in enumerate(starts):
        for rank, got in enumerate(results):
            for n in COUNTS:
                torch.testing.assert_close(got["outs"][n], want[n], atol=1e-5, rtol=0,
                                           msg=lambda m, at=(start, rank, n): f"start, rank, n {at}: {m}")
            assert got["fallback"] is None and got["group_size"] == 2 and got["agreed"] > 0, got
    first, second = starts
    assert [(r["loaded"], r["compiled"]) for r in first] == [(0, 2), (0, 2)]  # one token, then symbolic
    assert second[0]["paths"] == first[0]["paths"] == second[1]["paths"]
    if style == "funcol" and second[0]["loaded"] == 0:  # torch 2.13 cannot rebuild the group's guard
        assert [(r["loaded"], r["compiled"]) for r in second] == [(0, 2), (0, 2)]
        assert not list(tmp_path.glob("stages/*"))
        assert all("not stored" in w and "ToyTP.group" in w for r in first for w in r["warnings"]), first
        assert all(r["warnings"] for r in first)
        return
    assert not any(r["warnings"] for start in starts for r in start)
    assert [(r["loaded"], r["compiled"]) for r in second] == [(2, 0), (2, 0)]
    assert all(r["times"] == ["read_back"] for r in second)  # no trace, no passes
    assert len(list(tmp_path.glob("stages/*"))) == 2  # one file per rank

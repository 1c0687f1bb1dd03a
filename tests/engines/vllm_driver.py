"""Runs vLLM (its CPU build) on a tiny random Llama, eagerly and compiled with ``pp_breakable``, and writes
what happened as JSON. Run it with ``.venv-vllm/bin/python`` (made by ``scripts/vllm_env.sh``); the main
venv's pytest never imports it: ``tests/engines/test_vllm_cpu.py`` runs it by subprocess.

    .venv-vllm/bin/python tests/engines/vllm_driver.py --out result.json [--runs eager,pp1,pp2]

Runs, each in a fresh process of its own (vLLM's process-wide state and Dynamo's caches never carry over):

* ``eager``: PP1, compilation mode 0 (``enforce_eager``): the reference tokens;
* ``pp1``: PP1, compilation mode 2 (DYNAMO_TRACE_ONCE: vLLM calls ``torch.compile`` on the whole forward,
  every guard dropped) with backend ``pp_breakable``, in the engine's process;
* ``pp1_restart`` (after ``pp1``): ``pp1`` started again on ``pp1``'s vLLM cache, so vLLM loads the
  compile it stored there (Dynamo's bytecode and ppcompile's stored stage) instead of compiling;
* ``pp2``: the same as ``pp1`` at ``pipeline_parallel_size=2``: two spawned worker processes, one stage
  each.

vLLM runs with its default settings: on torch >= 2.10 it compiles the forward through Dynamo's
``aot_compile`` and stores the result (``VLLM_USE_AOT_COMPILE``), which ppcompile's backend supports. Each
run has a vLLM cache of its own (``VLLM_CACHE_ROOT`` under the work dir), so no run loads another's
compile, nor one a former driver stored; ``pp1_restart`` alone shares ``pp1``'s, on purpose.

vLLM hands a backend other than Inductor no options, so ppcompile's come through ``PPCOMPILE_OPTIONS``,
which the spawned workers inherit: graph mode ``emulate`` (the graph path on CPU), a few capture sizes and
a ``dump_dir`` per run, under which every process that compiles a stage writes ``rank_<r>/<stage graph>/``
(the graphs and ``report.json``). After generating, every worker is asked (``LLM.collective_rpc``) for its
``ppcompile.counters`` and its stage runtimes, and rewrites its reports with what it served.

The result: per run, the greedy tokens and, per worker, its rank, the decoder layers vLLM gave its stage,
and per compiled stage the segments, the breaks (op, kind, detail), the layers ppcompile attributed,
captures and replays, and vLLM's compilation counters (AOT compiles, artifacts saved and loaded); also the
reports read back from the dump folder. ``--options`` adds ppcompile options
(``'{"token_local_ops": ["_C::rotary_embedding"]}'``), ``--compilation`` vLLM ``compilation_config`` keys.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

# head_dim 32: vLLM's CPU attention needs at least 32. Four layers: two per stage at PP2.
MODEL = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512, "max_position_embeddings": 256}
# Prompts of different lengths, prefilled in one forward of 23 tokens (bucket 32), then decoded 3 tokens
# a forward (bucket 4): both padded.
PROMPT_LENGTHS = (3, 7, 13)
NEW_TOKENS = 4
# vLLM's profile run (max_num_batched_tokens) is above the cap, so it runs eagerly.
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64]
MAX_BATCHED_TOKENS = 128
RUNS: dict[str, dict[str, Any]] = {
    "eager": {"pp": 1, "compiled": False},
    "pp1": {"pp": 1, "compiled": True},
    "pp1_restart": {"pp": 1, "compiled": True, "cache_of": "pp1"},
    "pp2": {"pp": 2, "compiled": True},
}
BACKEND = "pp_breakable"  # ppcompile's torch_dynamo_backends entry point
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc of the probe function
            "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"}


def make_model(folder: str) -> None:
    """A random-weight Llama saved to ``folder`` (config and safetensors; no tokenizer)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL, tie_word_embeddings=False))
    # A wider spread than the default init: clear margins between the top logits, so that the greedy
    # tokens do not hinge on rounding differences between eager runs and padded graph runs.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder)


def prompts() -> list[list[int]]:
    return [[(7 * i + 13 * n + 1) % MODEL["vocab_size"] for i in range(n)] for n in PROMPT_LENGTHS]


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """The facts of a stage report (``ppcompile.debug.build_report``) that the test reads."""
    breaks = []
    for seg in report["segments"]:
        if seg["kind"] != "break":
            continue
        why = seg["break_reason"] or {}
        breaks.append({"op": why.get("op"), "kind": why.get("kind"), "detail": why.get("detail"),
                       "layer_ids": seg["layer_ids"], "nodes": seg["nodes"]})
    return {
        "stage_graph": report["stage_graph"],
        "rank": report["rank"],
        "graph_mode": report["graph_mode"],
        "eager_reason": report["eager_reason"],
        "token_symbol": report["token_symbol"],
        "layer_ids": report["layer_ids"],
        "segments": len(report["segments"]),
        "graph_segments": len(report["segments"]) - len(breaks),
        "breaks": breaks,
        "captures": report["captures"]["count"],
        "forwards": report["traffic"]["forwards"],
        "fall_offs": report["fall_offs"],
    }


def probe_worker(worker: Any) -> dict[str, Any]:
    """Runs in each vLLM worker (``collective_rpc``): the decoder layers of its stage, its ppcompile
    counters and stage runtimes; rewrites each stage's report in ``dump_dir`` with what it served."""
    import torch.distributed as dist

    import ppcompile
    from ppcompile.debug import build_report, publish_report

    decoder = getattr(worker.model_runner.model, "model", None)  # LlamaModel: this stage's layer range
    start, end = getattr(decoder, "start_layer", None), getattr(decoder, "end_layer", None)
    stages = []
    for rt in ppcompile.stage_runtimes():
        publish_report(rt)
        stages.append({**summarize(build_report(rt)), "describe": rt.describe()})
    from vllm.compilation.counter import compilation_counter

    counters = json.loads(json.dumps(ppcompile.counters.snapshot(), default=str))
    vllm_counters = {k: v for k, v in vars(compilation_counter).items() if "aot" in k}
    return {"pid": os.getpid(), "rank": dist.get_rank() if dist.is_initialized() else None,
            "decoder_layers": None if start is None else list(range(start, end)),
            "ppcompile": os.path.dirname(ppcompile.__file__), "counters": counters, "stages": stages,
            "vllm_counters": vllm_counters}


def run_one(name: str, model_dir: str, dump_dir: str, options: dict[str, Any],
            compilation: dict[str, Any]) -> dict[str, Any]:
    """One run, in this process: load, generate, probe the workers of a compiled run."""
    spec = RUNS[name]
    os.environ["PPCOMPILE_OPTIONS"] = json.dumps(
        {"graph_mode": "emulate", "capture_sizes": CAPTURE_SIZES, "dump_dir": dump_dir, **options})
    import vllm
    from vllm import LLM, SamplingParams

    if spec["compiled"]:
        config: dict[str, Any] = {"mode": 2, "backend": BACKEND, "cudagraph_mode": "NONE", **compilation}
    else:
        config = {"mode": 0}
    start = time.monotonic()
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", seed=0, max_model_len=128,
              max_num_seqs=8, max_num_batched_tokens=MAX_BATCHED_TOKENS, pipeline_parallel_size=spec["pp"],
              distributed_executor_backend="mp" if spec["pp"] > 1 else None,
              enforce_eager=not spec["compiled"], compilation_config=config)
    loaded = time.monotonic()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    generated = time.monotonic()
    result: dict[str, Any] = {
        "vllm": vllm.__version__, "pp": spec["pp"], "compiled": spec["compiled"],
        "compilation_config": config, "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "workers": [], "probe_error": None,
        "phase_seconds": {"load": round(loaded - start, 1), "generate": round(generated - loaded, 1)}}
    if spec["compiled"]:
        try:
            result["workers"] = llm.collective_rpc(probe_worker, timeout=120)
        except Exception as e:  # the reports in dump_dir still tell the compile-time facts
            result["probe_error"] = f"{type(e).__name__}: {e}"
    return result


def read_reports(dump_dir: str) -> list[dict[str, Any]]:
    """The stage reports the run's processes wrote under ``dump_dir``, summarized."""
    from ppcompile.debug import load_reports

    if not os.path.isdir(dump_dir):
        return []
    return [{"file": os.path.relpath(f, dump_dir), **summarize(r)} for f, r in load_reports(dump_dir)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="where to write the JSON result")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--options", default="{}", help="more ppcompile options (a JSON object)")
    parser.add_argument("--compilation", default="{}", help="more compilation_config keys for compiled runs")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run (default 300)")
    parser.add_argument("--work-dir", help="where the model, dumps and logs go (default: a new temp dir)")
    parser.add_argument("--run-one", help=argparse.SUPPRESS)  # internal: this process runs that run
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--dump-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    options, compilation = json.loads(args.options), json.loads(args.compilation)
    if args.run_one:
        result = run_one(args.run_one, args.model, args.dump_dir, options, compilation)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
        return 0

    runs = args.runs.split(",")
    unknown = sorted(set(runs) - set(RUNS))
    if unknown:
        parser.error(f"unknown run(s) {unknown}; known: {', '.join(RUNS)}")
    for name in runs:
        first = RUNS[name].get("cache_of")
        if first is not None and (first not in runs or runs.index(first) > runs.index(name)):
            parser.error(f"run {name} restarts on the cache of run {first}, which must run before it")
    work = args.work_dir or tempfile.mkdtemp(prefix="ppcompile-vllm-")
    os.makedirs(work, exist_ok=True)
    model_dir = os.path.join(work, "model")
    make_model(model_dir)
    result: dict[str, Any] = {
        "model": MODEL, "prompt_lengths": list(PROMPT_LENGTHS), "new_tokens": NEW_TOKENS,
        "capture_sizes": CAPTURE_SIZES, "options": options, "compilation": compilation, "work_dir": work,
        "runs": {}}
    for name in runs:
        dump_dir = os.path.join(work, f"dumps-{name}")
        out = os.path.join(work, f"run-{name}.json")
        log_file = os.path.join(work, f"run-{name}.log")
        cache_root = os.path.join(work, f"vllm-cache-{RUNS[name].get('cache_of', name)}")
        cmd = [sys.executable, os.path.abspath(__file__), "--out", out, "--options", args.options,
               "--compilation", args.compilation, "--run-one", name, "--model", model_dir,
               "--dump-dir", dump_dir]
        start = time.monotonic()
        with open(log_file, "w") as log:
            # A session of its own: on a timeout the run goes with the PP workers it spawned.
            proc = subprocess.Popen(cmd, env={**os.environ, **VLLM_ENV, "VLLM_CACHE_ROOT": cache_root},
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc: int | str = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = "timeout"
        run: dict[str, Any] = {"rc": rc, "seconds": round(time.monotonic() - start, 1), "log": log_file,
                               "vllm_cache_root": cache_root}
        if rc == 0:
            with open(out) as f:
                run.update(json.load(f))
        else:
            with open(log_file, errors="replace") as f:
                run["log_tail"] = f.read()[-8000:]
        run["reports"] = read_reports(dump_dir)
        result["runs"][name] = run
        print(f"vllm_driver: {name}: exit {rc} in {run['seconds']} s (log: {log_file})", file=sys.stderr)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# GPU check, sized for ONE command on one H200 with cold caches: at most BUDGET_S (480 s) in all. In order:
#   preflight           bench/gpu_preflight.py: versions, device, C compiler, Python headers, one fused
#                       copy (which kernel `copy_kernel="auto"` ends up with), one CUDA graph capture,
#                       one capture of a one-rank NCCL all-reduce
#   pytest_gpu          the GPU tests, by an explicit file list (GPU_TESTS; correctness before figures),
#                       a one-rank NCCL TP stage among them
#   throughput_profile  prefill throughput with CUDA graphs, then wall vs busy (one process, one compile)
#   overhead            the runtime's host overhead per forward and per segment
#                       (and what a copy-in calls; CUDAGraph.replay() vs a direct cudaGraphLaunch)
#   lazy_capture        startup: graphs captured and first-forward seconds, all vs lazy vs planned ladder
#                       (and where each graph's capture time goes: warm-ups, begin, recording, end)
#   fold_segments       where folding a tiny graph segment into its breaks stops paying
#   launches            launches outside graph replays per forward (torch vs fused copies)
#   fused_copy          the fused copy kernel's host time against per-tensor torch ops
#   pp_streams          two PP stages on one device, the hand-over on a second stream: wall per
#                       micro-batch with the output ring and event fences vs waiting, host syncs counted
#   owned_outputs       what the default's output copies cost per forward against views, 16 and 2048 tokens
#   whole_stage         tiny prefills (1, 16, 64, 256 tokens; 1 and 8 requests): whole-stage graphs vs the
#                       breakable path vs eager, graphs and memory
# Each step runs under its own time limit (PLAN below, the one place limits live; TERM 5 s before the
# limit, KILL at it) and writes its log (and JSON/figures) before the next starts, with one line in
# summary.txt, so a run cut off anywhere still leaves what it measured. A failing step does not stop the
# ones after it.
#
# Everything lands in one folder, $OUT if set, else bench/results/gpu: preflight.json, a log per step,
# pytest_gpu.xml (junit), the JSON results, the plot, summary.txt, and benchmarks.md (a preview of the
# docs section). Back on any machine with the repo:
#     python -m ppcompile bench --render <that folder>     # writes docs/benchmarks.md + plot
#
# Needs torch with CUDA (2.11+; triton for the fused copies and the Inductor paths) and no network.
# Without a CUDA device it says so and exits 0. Options:
#   --dry-run      the same steps on CPU with tiny sizes (to test this script; DRY_PLAN's limits)
#   --print-plan   print the steps, their limits, the overhead allowance and the GPU test files, one
#                  "key value..." line each, and exit 0 without running anything (needs no torch)
# PYTHON picks the interpreter (default: python3; in a dry run .venv/bin/python when present).
set -uo pipefail
cd "$(dirname "$0")/.."

# ------------------------------------------------------------------------------------------ the plan
BUDGET_S=480
# Steps in the order they run, name=limit in seconds (each limit includes the step's torch start-up).
# Sized from the H200 runs of 2026-12-04 (cold caches; docs/benchmarks.md, "The GPU check"): preflight
# 11 s, pytest_gpu 37, throughput_profile 74 (every path compiled under a 120 s limit), overhead 46,
# lazy_capture 35, fold_segments 21, launches 17, fused_copy 16, pp_streams 23: 280 s of steps.
# owned_outputs and whole_stage (added since) have not run on a GPU yet; the limits of the steps measured
# above were trimmed to make room for whole_stage (three 16-layer paths, lazy capture of 3 buckets).
# overhead has since gained a back-to-back loop, one profiled call and the graph-launch comparison (a
# few seconds, the profiler's CUDA start-up the most): 6 s from pp_streams' spare 12.
PLAN=(preflight=20 pytest_gpu=45 throughput_profile=90 overhead=56 lazy_capture=40 fold_segments=25
      launches=20 fused_copy=20 pp_streams=29 owned_outputs=30 whole_stage=35)
# Outside the steps, each under its own timeout: pip install -e ., the torch/CUDA probe, the render of
# benchmarks.md, and the shell itself (nvidia-smi, copies).
OVERHEAD=(pip=20 probe=20 render=25 shell=5)
# The dry run (CPU, tiny sizes; a slow 2-core box takes about 3 minutes): limits only stop a hang.
DRY_PLAN=(preflight=60 pytest_gpu=120 throughput_profile=90 overhead=60 lazy_capture=120 fold_segments=60
          launches=60 fused_copy=40 pp_streams=60 owned_outputs=120 whole_stage=120)
# The test files with GPU tests (`pytest.mark.gpu`), correctness first; run with `-m gpu`.
# tests/bench/test_gpu_check_plan.py checks this list against the files that have the mark.
GPU_TESTS=(
  tests/runtime/test_cuda_graphs_gpu.py
  tests/runtime/test_tensor_parallel_gpu.py
  tests/reliability/test_reliability_gpu.py
  tests/runtime/test_in_place_breaks.py
  tests/runtime/test_out_variant_breaks.py
  tests/runtime/test_fused_copy.py
  tests/debug/test_debug_report.py
  tests/backends/test_warm_start_gpu.py
  tests/tracing/test_layer_stamps.py
)
# Steps whose log is also kept as NAME.txt (docs/benchmarks.md names these files).
TXT_STEPS=" lazy_capture fold_segments launches fused_copy pp_streams owned_outputs whole_stage "

usage() { echo "usage: bash bench/gpu_check.sh [--dry-run] [--print-plan]" >&2; exit 2; }
dry=0
print_plan=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry=1 ;;
    --print-plan) print_plan=1 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) usage ;;
  esac
done
[ "$dry" = 1 ] && plan=("${DRY_PLAN[@]}") || plan=("${PLAN[@]}")
overhead_s=0
for entry in "${OVERHEAD[@]}"; do overhead_s=$((overhead_s + ${entry#*=})); done
limit_of() {  # limit_of NAME: NAME's entry of OVERHEAD
  local entry
  for entry in "${OVERHEAD[@]}"; do [ "${entry%%=*}" = "$1" ] && { echo "${entry#*=}"; return; }; done
  echo "gpu_check: no overhead entry $1" >&2; exit 2
}

if [ -n "${PYTHON:-}" ]; then py=$PYTHON
elif [ "$dry" = 1 ] && [ -x .venv/bin/python ]; then py=.venv/bin/python
else py=python3
fi
results=${OUT:-bench/results/gpu}
[ "$dry" = 1 ] && [ -z "${OUT:-}" ] && results=bench/results/gpu-dry-run
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

if [ "$dry" = 1 ]; then
  dev=cpu
  bench_args=(--device cpu --suite smoke)
  fold_args=(--device cpu --graph-mode emulate --ks 1,2)
  copy_args=(--dry-run)
  owned_args=(--device cpu --tokens 4,16 --hidden 64 --layers 4 --rounds 1)
  whole_args=(--device cpu --tokens 16 --calls 2)
else
  dev=cuda
  bench_args=(--device cuda --suite cuda)
  fold_args=(--device cuda)
  copy_args=()
  owned_args=(--device cuda)
  whole_args=(--device cuda)
fi

command_of() {  # command_of NAME LIMIT: sets cmd to step NAME's command line
  case "$1" in
    preflight) cmd=("$py" bench/gpu_preflight.py --device "$dev" --out "$results/preflight.json") ;;
    # -v: a line per test as it ends (a cut-off run still shows them); one file failing to import does
    # not stop the others.
    pytest_gpu) cmd=("$py" -m pytest -m gpu -v -rA -p no:cacheprovider --durations=8
                     --continue-on-collection-errors --junitxml="$results/pytest_gpu.xml" "${GPU_TESTS[@]}") ;;
    # Throughput and profile share one process (one compile of every path). throughput.json is saved
    # after every repeat; past 60% of --budget-s (so 40% of this step's limit) no path starts its compile
    # and no repeat starts: the rest of the limit is for a compile under way, one repeat, the profile.
    throughput_profile) cmd=("$py" -m ppcompile bench --only throughput,profile --out "$results" --no-docs
                             --budget-s "$(($2 * 2 / 3))" "${bench_args[@]}") ;;
    overhead) cmd=("$py" -m ppcompile bench --only overhead --out "$results" --no-docs "${bench_args[@]}") ;;
    lazy_capture) cmd=("$py" bench/lazy_capture.py --device "$dev") ;;
    fold_segments) cmd=("$py" bench/fold_segments.py "${fold_args[@]}") ;;
    launches) cmd=("$py" bench/launches.py --device "$dev" --out "$results") ;;
    fused_copy) cmd=("$py" bench/fused_copy.py --out "$results" "${copy_args[@]}") ;;
    pp_streams) cmd=("$py" bench/pp_streams.py --device "$dev" --out "$results") ;;
    owned_outputs) cmd=("$py" bench/owned_outputs.py --out "$results" "${owned_args[@]}") ;;
    whole_stage) cmd=("$py" bench/whole_stage.py --out "$results" "${whole_args[@]}") ;;
    *) echo "gpu_check: no command for step $1" >&2; return 1 ;;
  esac
}

if [ "$print_plan" = 1 ]; then
  [ "$dry" = 1 ] && echo "mode dry-run" || echo "mode gpu"
  [ "$dry" = 1 ] && echo "budget none" || echo "budget $BUDGET_S"
  total=$overhead_s
  for entry in "${plan[@]}"; do
    echo "step ${entry%%=*} ${entry#*=}"
    total=$((total + ${entry#*=}))
    command_of "${entry%%=*}" "${entry#*=}" || exit 2
    echo "command ${entry%%=*} ${cmd[*]}"
  done
  echo "overhead $overhead_s"
  for entry in "${OVERHEAD[@]}"; do echo "overhead_part ${entry%%=*} ${entry#*=}"; done
  echo "total $total"
  for f in "${GPU_TESTS[@]}"; do echo "gpu_tests $f"; done
  exit 0
fi

# One torch start-up says both whether torch imports and whether it sees a CUDA device.
probe='import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)'
[ "$dry" = 1 ] && probe='import torch'

timeout --kill-after=2 "$(( $(limit_of probe) - 2 ))" "$py" -c "$probe" 2>/dev/null
rc=$?
if [ "$rc" = 3 ]; then
  echo "gpu_check: torch ($py) sees no CUDA device here; nothing to run." \
       "Use --dry-run to exercise this script on CPU."
  exit 0
elif [ "$rc" != 0 ]; then
  echo "gpu_check: $py cannot import torch (rc=$rc); set PYTHON to an interpreter that has it" >&2
  exit 1
fi
mkdir -p "$results"
: >"$results/summary.txt"

if [ "$dry" = 0 ]; then
  # The entry point makes the backend known to torch.compile without an import; PYTHONPATH covers the
  # rest if this fails (no network: no build isolation).
  timeout --kill-after=2 "$(( $(limit_of pip) - 2 ))" \
    "$py" -m pip install --no-deps --no-build-isolation -q -e . >"$results/pip.log" 2>&1 \
    || echo "gpu_check: pip install -e . failed (see pip.log); using PYTHONPATH" | tee -a "$results/summary.txt"
fi

{
  date -u '+%Y-%m-%d %H:%M UTC'
  timeout 5 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null \
    || echo "nvidia-smi: not available"
  echo "versions, device, compiler: preflight.json"
} >"$results/env.txt" 2>&1
cat "$results/env.txt"

render_s=$(limit_of render)
step() {  # step NAME LIMIT: runs the step under its limit, log in NAME.log, one line in summary.txt
  local name=$1 limit=$2
  local start=$SECONDS note=""
  local left=$((BUDGET_S - SECONDS - render_s))  # never eat the render's time or the budget
  if [ "$dry" = 0 ] && [ "$left" -lt "$limit" ]; then
    limit=$left
    note=" (limit cut to what the budget has left)"
  fi
  if [ "$limit" -lt 10 ]; then
    echo "$name: skipped: ${left} s of the budget left" | tee -a "$results/summary.txt"
    return
  fi
  command_of "$name" "$limit" || return
  echo "== $name (limit ${limit}s): ${cmd[*]}"
  timeout --kill-after=5 "$((limit - 5))" "${cmd[@]}" >"$results/$name.log" 2>&1
  local rc=$?
  { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && note="$note (timed out)"
  echo "$name: rc=$rc$note in $((SECONDS - start)) s (limit ${limit} s)" | tee -a "$results/summary.txt"
  case "$TXT_STEPS" in *" $name "*) cp "$results/$name.log" "$results/$name.txt" ;; esac
  tail -n 25 "$results/$name.log"
}

for entry in "${plan[@]}"; do
  step "${entry%%=*}" "${entry#*=}"
done
timeout --kill-after=2 "$((render_s - 2))" \
  "$py" -m ppcompile bench --render "$results" --docs-file "$results/benchmarks.md" 2>&1 \
  | tee -a "$results/summary.txt"
[ "$dry" = 1 ] && budget_note="" || budget_note=" (budget $BUDGET_S s)"
echo "gpu_check: done in $SECONDS s$budget_note; results in $results (summary.txt, preflight.json," \
     "benchmarks.md)" | tee -a "$results/summary.txt"

#!/usr/bin/env bash
# GPU check, sized for one H200 in under 10 minutes: the GPU tests, then the prefill benchmarks with
# CUDA graphs (throughput, wall vs busy, runtime overhead), lazy vs full capture, the fold crossover,
# launches outside graphs (torch vs fused copies) and the fused copy kernel's host time.
# Everything lands in one folder, $OUT if set, else bench/results/gpu: a log per step, the JSON results,
# the plot, summary.txt, and benchmarks.md (a preview of the docs section). Back on any machine with the repo:
#     python -m ppcompile bench --render <that folder>     # writes docs/benchmarks.md + plot
#
# Needs torch with CUDA (2.11+; triton for the Inductor paths) and no network. Without a CUDA device it
# says so and exits 0; `--dry-run` runs the same steps on CPU with tiny sizes (to test this script).
# PYTHON picks the interpreter (default: python3; in a dry run .venv/bin/python when present).
set -uo pipefail
cd "$(dirname "$0")/.."

dry=0
case "${1:-}" in
  --dry-run) dry=1 ;;
  "") ;;
  *) echo "usage: bash bench/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac

if [ -n "${PYTHON:-}" ]; then py=$PYTHON
elif [ "$dry" = 1 ] && [ -x .venv/bin/python ]; then py=.venv/bin/python
else py=python3
fi
results=${OUT:-bench/results/gpu}
[ "$dry" = 1 ] && [ -z "${OUT:-}" ] && results=bench/results/gpu-dry-run
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

if ! "$py" -c 'import torch' 2>/dev/null; then
  echo "gpu_check: $py cannot import torch; set PYTHON to an interpreter that has it" >&2
  exit 1
fi
if [ "$dry" = 0 ] && ! "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)'; then
  echo "gpu_check: torch ($py) sees no CUDA device here; nothing to run." \
       "Use --dry-run to exercise this script on CPU."
  exit 0
fi
mkdir -p "$results"
: >"$results/summary.txt"

if [ "$dry" = 1 ]; then
  bench_args=(--device cpu --suite smoke)
  limits=(60 90 60)  # pytest, throughput + profile, overhead (seconds)
else
  bench_args=(--device cuda --suite cuda)
  limits=(120 200 60)  # the GPU tests first: no CUDA run has happened yet, correctness outranks figures
  # The entry point makes the backend known to torch.compile without an import; PYTHONPATH covers the
  # rest if this fails (no network: no build isolation).
  "$py" -m pip install --no-deps --no-build-isolation -q -e . >"$results/pip.log" 2>&1 \
    || echo "gpu_check: pip install -e . failed (see pip.log); using PYTHONPATH" | tee -a "$results/summary.txt"
fi

step() {  # step NAME LIMIT_S CMD...: runs CMD under a time limit, log in NAME.log, one line in summary.txt
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" >"$results/$name.log" 2>&1
  local rc=$?
  local note=""
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && note=" (timed out)"
  echo "$name: rc=$rc$note in $((SECONDS - start)) s" | tee -a "$results/summary.txt"
  tail -n 25 "$results/$name.log"
}

{
  date -u '+%Y-%m-%d %H:%M UTC'
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null \
    || echo "nvidia-smi: not available"
  "$py" -c 'import platform, torch; print("python", platform.python_version(), "torch", torch.__version__,
"cuda", torch.version.cuda, "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)'
  "$py" -c 'import triton; print("triton", triton.__version__)' 2>/dev/null || echo "triton: not installed"
} >"$results/env.txt" 2>&1
cat "$results/env.txt"

step pytest_gpu "${limits[0]}" "$py" -m pytest -m gpu -q -p no:cacheprovider --durations=8 tests
# Throughput and profile share one process (one compile of every path); throughput.json is saved after
# every repeat, and no repeat starts past 60% of the budget, so a slow compile still leaves figures.
step throughput_profile "${limits[1]}" "$py" -m ppcompile bench --only throughput,profile --out "$results" \
  --no-docs --budget-s "$((limits[1] - 60))" "${bench_args[@]}"
step overhead "${limits[2]}" "$py" -m ppcompile bench --only overhead --out "$results" --no-docs \
  "${bench_args[@]}"
# Startup: graphs captured and seconds of the first forward, and pool growth: all vs lazy vs planned.
step lazy_capture 75 "$py" bench/lazy_capture.py --device "$([ "$dry" = 1 ] && echo cpu || echo cuda)"
cp "$results/lazy_capture.log" "$results/lazy_capture.txt" 2>/dev/null
# Where folding a tiny graph segment into its breaks stops paying (DEFAULT_FOLD_GRAPH_OPS follows it).
if [ "$dry" = 1 ]; then fold_args=(--device cpu --graph-mode emulate --ks 1,2); else fold_args=(--device cuda); fi
step fold_segments 45 "$py" bench/fold_segments.py "${fold_args[@]}"
cp "$results/fold_segments.log" "$results/fold_segments.txt" 2>/dev/null
# Launches outside graph replays per forward, by kind: per-tensor torch copies vs one fused launch.
step launches 40 "$py" bench/launches.py --device "$([ "$dry" = 1 ] && echo cpu || echo cuda)" --out "$results"
cp "$results/launches.log" "$results/launches.txt" 2>/dev/null
if [ "$dry" = 1 ]; then copy_args=(--dry-run); else copy_args=(); fi
step fused_copy 30 "$py" bench/fused_copy.py --out "$results" "${copy_args[@]}"
cp "$results/fused_copy.log" "$results/fused_copy.txt" 2>/dev/null
"$py" -m ppcompile bench --render "$results" --docs-file "$results/benchmarks.md" 2>&1 | tee -a "$results/summary.txt"
echo "gpu_check: done; results in $results (summary.txt, benchmarks.md)"

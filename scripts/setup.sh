#!/usr/bin/env bash
# Creates .venv (once) and installs ppcompile with its test tools and the optional Hugging Face
# extra (transformers), so the tests of ppcompile.models.hf run too. The test tools include triton
# (a ~190 MB wheel): the fused copy-in kernel's tests run it on CPU through Triton's interpreter.
# On a machine without an NVIDIA GPU it pins the CPU build of torch (constraints/cpu.txt);
# an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
pip_args=(-q --disable-pip-version-check)
if ! command -v nvidia-smi >/dev/null 2>&1; then
  pip_args+=(-c constraints/cpu.txt)
fi
.venv/bin/python -m pip install "${pip_args[@]}" -e ".[test,hf]"

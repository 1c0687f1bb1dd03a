#!/usr/bin/env bash
# Runs the test suite on another torch release: bash scripts/compat.sh 2.11.0 [pytest args...]
# pyproject asks for torch>=2.11 while CI runs 2.13; this checks the older end of that range.
# Builds .venv-<VERSION> (once; reused while it holds that torch) with torch==VERSION from PyPI plus the
# test and hf extras, then runs `python -m pytest` there with the remaining args.
# PyPI's Linux torch is a CUDA build (several GB with its nvidia wheels); it also runs on CPU.
# PYTHON picks the interpreter for a new venv (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: bash scripts/compat.sh TORCH_VERSION [pytest args...]}
shift
VENV=.venv-$VERSION
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
have=$("$VENV/bin/python" -c 'import torch, ppcompile; print(torch.__version__.split("+")[0])' 2>/dev/null \
  || true)
if [ "$have" != "$VERSION" ]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==$VERSION" -e ".[test,hf]"
fi
"$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'
exec "$VENV/bin/python" -m pytest "$@"

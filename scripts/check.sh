#!/usr/bin/env bash
# What CI checks (after scripts/setup.sh): ruff and mypy clean, modules within their line caps, then the test
# suite. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check ppcompile tests bench scripts
.venv/bin/mypy
.venv/bin/python scripts/check_caps.py
exec .venv/bin/python -m pytest "$@"

#!/usr/bin/env bash
# Set up ddpx from this checkout: torch, build tools, then an editable install that
# builds the C++ extension against the installed torch (no isolated build env, which
# would download another torch).
#   bash scripts/setup.sh        runtime only
#   bash scripts/setup.sh test   plus the test dependencies
# Override the torch requirement with DDPX_TORCH (e.g. DDPX_TORCH="torch" on a GPU box
# that already has a CUDA torch; the default is the CPU wheel pinned for this project's CI).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_REQ=${DDPX_TORCH:-torch==2.13.0}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install "$TORCH_REQ"
fi
"$PY" -m pip install setuptools wheel ninja pybind11
EXTRA=""
[ "${1:-}" = "test" ] && EXTRA="[test]"
MAX_JOBS=${MAX_JOBS:-2} "$PY" -m pip install --no-build-isolation -e ".${EXTRA}"

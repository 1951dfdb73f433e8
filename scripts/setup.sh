#!/usr/bin/env bash
# Set up ddpx from this checkout: torch, build tools, then an editable install that
# builds the C++ extension against the installed torch (no isolated build env, which
# would download another torch).
#   bash scripts/setup.sh        runtime only
#   bash scripts/setup.sh test   plus the test dependencies
# On a system python that is "externally managed" (PEP 668: Debian, Ubuntu, Fedora's
# python3), pip refuses to install into it: the script then creates ./.venv, installs
# there and says how to activate it. Inside a virtual environment it installs there.
# Override the torch requirement with DDPX_TORCH (e.g. DDPX_TORCH="torch" on a GPU box
# that already has a CUDA torch; the default is the CPU wheel pinned for this project's CI).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
externally_managed() {
    "$1" -c 'import os, sys, sysconfig
in_venv = sys.prefix != sys.base_prefix
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
sys.exit(0 if not in_venv and os.path.exists(marker) else 1)'
}
VENV=""
if externally_managed "$PY"; then
    VENV=${DDPX_VENV:-.venv}
    echo "setup.sh: $PY is externally managed (PEP 668): installing into $VENV"
    if [ ! -x "$VENV/bin/python" ]; then
        "$PY" -m venv "$VENV" || { echo "setup.sh: cannot create $VENV: install python3-venv (apt install python3-venv) or set PYTHON=/path/to/a/venv/python" >&2; exit 1; }
    fi
    PY=$VENV/bin/python
    "$PY" -m pip install -q --upgrade pip
fi
TORCH_REQ=${DDPX_TORCH:-torch==2.13.0}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install "$TORCH_REQ"
fi
"$PY" -m pip install setuptools wheel ninja pybind11
EXTRA=""
[ "${1:-}" = "test" ] && EXTRA="[test]"
MAX_JOBS=${MAX_JOBS:-2} "$PY" -m pip install --no-build-isolation -e ".${EXTRA}"
if [ -n "$VENV" ]; then
    echo "setup.sh: done; activate the environment with:  . $VENV/bin/activate"
fi

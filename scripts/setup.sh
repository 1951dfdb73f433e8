#!/usr/bin/env bash
# Set up ddpx from this checkout: torch, build tools, then an editable install that
# builds the C++ extension against the installed torch (no isolated build env, which
# would download another torch).
#   bash scripts/setup.sh                      runtime only
#   bash scripts/setup.sh test                 plus the test dependencies
#   bash scripts/setup.sh train [ARGS...]      runtime, then `ddpx train ARGS...` in the
#                                              environment it installed into
# On a system python that is "externally managed" (PEP 668: Debian, Ubuntu, Fedora's
# python3), pip refuses to install into it: the script then creates ./.venv, installs
# there and says how to activate it. Inside a virtual environment it installs there.
# torch: a torch already installed (your CUDA build, or the CPU one) is kept; else
# DDPX_TORCH (default torch==2.13.0) from pip's indexes. PyPI's Linux wheel of it is the
# CUDA build (several GB of NVIDIA libraries); a CPU wheel pip can see (a --find-links
# folder, as on this project's CI machine) is taken before it. The CPU build from the
# PyTorch index: install it into the environment first (README.md, set-up).
# The extension is compiled once: a later run (or another venv with the same torch)
# reuses ddpx/_C*.so while csrc/, setup.py and torch are unchanged
# (scripts/extension_build.py); the compile shows one line per file.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODE=${1:-}
case "$MODE" in
    ""|test) ;;
    train) shift ;;
    *) echo "setup.sh: unknown argument '$MODE': use no argument, 'test', or 'train [ddpx train arguments]'" >&2; exit 2 ;;
esac
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
    echo "setup.sh: installing $TORCH_REQ (a CPU wheel where pip sees one; from PyPI alone, on Linux, the CUDA build: several GB)"
    "$PY" -m pip install "$TORCH_REQ"
fi
"$PY" -m pip install -q setuptools wheel ninja pybind11
EXTRA=""
[ "$MODE" = "test" ] && EXTRA="[test]"
# pip -v into a log; on the terminal what pip says without -v, plus one line per compiled file
LOG=$(mktemp "${TMPDIR:-/tmp}/ddpx-install-log.XXXXXX")
echo "setup.sh: installing ddpx$EXTRA from this checkout; the first build of its C++ extension takes" \
     "about 5 minutes on 2 cores (pip's whole output: $LOG)"
set +e
MAX_JOBS=${MAX_JOBS:-2} "$PY" -m pip install -v --no-build-isolation -e ".${EXTRA}" 2>&1 | tee "$LOG" |
    "$PY" scripts/extension_build.py progress
status=("${PIPESTATUS[@]}")
set -e
if [ "${status[0]}" -ne 0 ]; then
    tail -n 40 "$LOG" >&2
    echo "setup.sh: pip install failed (exit ${status[0]}); its whole output: $LOG" >&2
    exit "${status[0]}"
fi
rm -f "$LOG"
if [ -n "$VENV" ]; then
    echo "setup.sh: done; activate the environment with:  . $VENV/bin/activate"
fi
if [ "$MODE" = "train" ]; then
    echo "setup.sh: ddpx train${*:+ $*} (with $PY)"
    exec "$PY" -m ddpx train "$@"
fi

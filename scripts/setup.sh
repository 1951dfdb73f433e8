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
# (scripts/extension_build.py). Every pip install shows a line per compiled file and
# speaks at least every 10 s (scripts/pip_progress.py); it first says which python and
# which site-packages it installs into.
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
LOG=$(mktemp "${TMPDIR:-/tmp}/ddpx-install-log.XXXXXX")
# pip install -v ARGS: its whole output into $LOG; on the terminal what pip says without -v,
# a line per compiled file, and a line at least every 10 s (scripts/pip_progress.py)
pip_install() {
    set +e
    "$PY" -m pip install -v "$@" 2>&1 | tee -a "$LOG" | "$PY" scripts/pip_progress.py
    local status=("${PIPESTATUS[@]}")
    set -e
    if [ "${status[0]}" -ne 0 ]; then
        tail -n 40 "$LOG" >&2
        echo "setup.sh: pip install $* failed (exit ${status[0]}); its whole output: $LOG" >&2
        exit "${status[0]}"
    fi
}
if externally_managed "$PY"; then
    VENV=${DDPX_VENV:-.venv}
    echo "setup.sh: $PY is externally managed (PEP 668): installing into $VENV"
    if [ ! -x "$VENV/bin/python" ]; then
        "$PY" -m venv "$VENV" || { echo "setup.sh: cannot create $VENV: install python3-venv (apt install python3-venv) or set PYTHON=/path/to/a/venv/python" >&2; exit 1; }
    fi
    PY=$VENV/bin/python
    pip_install --upgrade pip
fi
# where everything goes, said before anything is installed: a global interpreter (pyenv's,
# conda's base) gets torch and ddpx too
"$PY" -c 'import sys, sysconfig
where = sysconfig.get_paths()["purelib"]
if sys.prefix != sys.base_prefix:
    print(f"setup.sh: installing into the virtual environment {sys.prefix} ({where})")
else:
    print(f"setup.sh: installing into {sys.executable}, not a virtual environment: its packages in {where} "
          "get torch and ddpx (to keep them apart, activate a venv or set PYTHON=/path/to/venv/bin/python first)")' \
    || echo "setup.sh: installing into $PY"
echo "setup.sh: checking for an installed torch"
TORCH_REQ=${DDPX_TORCH:-torch==2.13.0}
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "setup.sh: installing $TORCH_REQ (a CPU wheel where pip sees one; from PyPI alone, on Linux, the CUDA build: several GB)"
    pip_install "$TORCH_REQ"
fi
pip_install setuptools wheel ninja pybind11
EXTRA=""
[ "$MODE" = "test" ] && EXTRA="[test]"
echo "setup.sh: installing ddpx$EXTRA from this checkout; the first build of its C++ extension takes" \
     "10 to 20 minutes on 2 busy cores, less on more (pip's whole output: $LOG)"
MAX_JOBS=${MAX_JOBS:-2} pip_install --no-build-isolation -e ".${EXTRA}"
# An editable install is not byte-compiled, and with PYTHONDONTWRITEBYTECODE set (many
# containers) every process would compile ddpx again: about 0.4 s of CPU per rank's start.
"$PY" -m compileall -q ddpx plugins >/dev/null
rm -f "$LOG"
if [ -n "$VENV" ]; then
    echo "setup.sh: done; activate the environment with:  . $VENV/bin/activate"
fi
if [ "$MODE" = "train" ]; then
    echo "setup.sh: ddpx train${*:+ $*} (with $PY)"
    exec "$PY" -m ddpx train "$@"
fi

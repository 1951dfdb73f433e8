#!/usr/bin/env bash
# The fast lane against the oldest and the newest torch ddpx supports, each in a venv
# of its own with the extension built against it (the README's "torch >= ..." rests
# on this script; it is too long for .ci/run: two torch installs and two builds).
#
#   bash scripts/compat.sh                          # torch 2.7.1 and 2.13.0 (the project's pin)
#   TORCH_VERSIONS="2.7.1" bash scripts/compat.sh   # just one
#
# Per version: a venv and a copy of this checkout (tracked and untracked, not ignored,
# files) under $COMPAT_DIR (default .compat/, git-ignored; kept, so a second run reuses
# the install and the built extension: scripts/extension_build.py), `scripts/setup.sh test` there with
# DDPX_TORCH=torch==VERSION, then `pytest -m "not slow" tests`. On Linux, PyPI's torch
# wheels bring the CUDA libraries along (about 3 GB for 2.4.1);
# the tests run on the CPU all the same. Logs: $COMPAT_DIR/torch-VERSION.log; the last
# lines printed are one summary line per version. Exit status: the first failure.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VERSIONS=${TORCH_VERSIONS:-"2.7.1 2.13.0"}
DIR=${COMPAT_DIR:-$ROOT/.compat}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
status=0
summary=()
for v in $VERSIONS; do
    venv="$DIR/torch-$v/venv" src="$DIR/torch-$v/src" log="$DIR/torch-$v.log"
    echo "== torch $v: $log"
    (
        set -e
        [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
        . "$venv/bin/activate"
        # the checkout as it is now, outside the tree: the in-place build must not replace this venv's
        mkdir -p "$src"
        git -C "$ROOT" ls-files -z -co --exclude-standard | (cd "$ROOT" && tar --null -T - -cf -) | tar -xf - -C "$src"
        if ! python -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$v')" 2>/dev/null; then
            python -m pip install "torch==$v"
        fi
        cd "$src"
        export PATH=/usr/lib/ccache:$PATH
        # the CPU extension: the fast lane runs on the CPU (a CUDA build against an old torch
        # would need that torch's CUDA toolkit)
        DDPX_CUDA=${DDPX_CUDA:-0} DDPX_TORCH="torch==$v" bash scripts/setup.sh test
        python -c "import torch, ddpx._C; print('torch', torch.__version__, 'ddpx._C built against it')"
        timeout 1200 python -m pytest -q -p no:cacheprovider -m "not slow" tests
    ) >"$log" 2>&1
    rc=$?
    line=$(grep -E "[0-9]+ (passed|failed)" "$log" | tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//')
    summary+=("torch $v: exit $rc: ${line:-no pytest summary, see $log}")
    [ $rc -ne 0 ] && [ $status -eq 0 ] && status=$rc
done
printf '%s\n' "${summary[@]}"
exit $status

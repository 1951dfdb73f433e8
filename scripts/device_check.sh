#!/usr/bin/env bash
# The checks that need a GPU, as one prepared run (device time is short, so nothing
# here is interactive): build the CUDA extension against the machine's own torch,
# run the CUDA tests (kernels against the CPU, every comm hook over NCCL), then the
# kernel benchmark on the GPU and on the CPU. Logs and
# JSON go to $OUT (the device tool's output folder; ./device-out elsewhere).
#   bash scripts/device_check.sh
# Each step runs even if an earlier one failed; the exit status is the first failure.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # built in place, not installed: tests' worker processes import ./ddpx
status=0
step() {  # step NAME COMMAND...: run, log to $OUT/NAME.log, remember the first failure
    local name=$1; shift
    echo "== $name: $*"
    "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.log"
    echo "== $name: exit $rc"
    [ $rc -ne 0 ] && [ $status -eq 0 ] && status=$rc
    return 0
}

step env bash -c "nvidia-smi; $PY -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())'"
# The machine's torch is not this project's pin: build against it, in place, no install.
step build env DDPX_CUDA=1 MAX_JOBS="$(nproc)" "$PY" setup.py build_ext --inplace
step tests_cuda "$PY" -m pytest -q -rs -m cuda tests/test_kernels.py tests/test_hooks_cuda.py
step tests_kernels "$PY" -m pytest -q tests/test_kernels.py
step bench_kernels_cuda "$PY" benchmarks/bench_kernels.py --device cuda --json --out "$OUT/bench_kernels_cuda.json"
step bench_kernels_cpu "$PY" benchmarks/bench_kernels.py --device cpu --json --out "$OUT/bench_kernels_cpu.json"
exit $status

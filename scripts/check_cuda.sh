#!/usr/bin/env bash
# Compile-check every plain-CUDA kernel file for sm_80 and sm_90 (no GPU needed).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null 2>&1; then
    echo "note: nvcc not found; skipping the CUDA compile check"
    exit 0
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
shopt -s globstar nullglob
n=0
for f in csrc/**/*.cu; do
    nvcc -c -std=c++17 -O3 -Icsrc \
        -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
        "$f" -o "$out/$(basename "$f").o"
    echo "nvcc ok: $f"
    n=$((n + 1))
done
echo "nvcc compile check: $n file(s) ok"

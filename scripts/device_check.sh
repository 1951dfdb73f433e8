#!/usr/bin/env bash
# The checks that need a GPU, as one prepared run (device time is short, so nothing
# here is interactive), under 8 minutes, ending with ONE JSON line (also written to
# $OUT/device_check.json): every step's status, time and figures.
#
#   bash scripts/device_check.sh          # on the GPU machine (the device tool: $OUT is its folder)
#   OUT=/tmp/dc bash scripts/device_check.sh   # anywhere else: a dry run, GPU steps skip with a reason
#
# Steps, most wanted first (a step that would not fit in what is left of the budget
# is skipped, and says so): build the CUDA extension in place against the machine's
# torch; the CUDA tests (kernels, every hook over NCCL, compile); trainer.strategy=fsdp
# through `ddpx train` (world 1 over NCCL, 2 ranks over gloo on the one GPU, with and without
# the int8 reduce-scatter); trainer.strategy=pipeline (against ddp) and tensor on the char GPT; the char GPT's
# steps/s and peak memory for no hook, int8, powersgd and compile, each against a
# hand-written DDP loop (benchmarks/bench_char_gpt.py, TORCH_LOGS=recompiles for the
# compile runs); every hook across 2 ranks over gloo with CUDA tensors
# (benchmarks/bench_comm_hooks_digits.py); the fast lane; PowerSGD's orthogonalization
# three ways; the kernel benchmarks. Without a GPU the benchmark scripts still run, on
# the CPU and short, so a broken script shows before the device time is spent.
# Each step runs even if an earlier one failed; the exit status is the first failure.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-460}  # the whole run, in seconds: under 8 minutes
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # built in place, not installed: tests' worker processes import ./ddpx
START=$(date +%s)
STEPS="$OUT/steps.jsonl"
: >"$STEPS"
status=0
GPU=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
NO_GPU="no CUDA device (torch.cuda.is_available() is false): a dry run"

record() {  # record NAME STATUS RC SECONDS REASON
    "$PY" -c 'import json, sys; n, s, rc, t, why = sys.argv[1:]; print(json.dumps({"step": n, "status": s, "rc": int(rc), "seconds": float(t), "reason": why}))' "$@" >>"$STEPS"
}

# step NAME [gpu] ESTIMATE_S CAP_S COMMAND...: run with a timeout of min(CAP_S, what is left),
# log to $OUT/NAME.log; skipped when `gpu` and there is none, or when ESTIMATE_S no longer fits.
step() {
    local name=$1; shift
    local needs_gpu=0
    if [ "$1" = gpu ]; then needs_gpu=1; shift; fi
    local estimate=$1 cap=$2; shift 2
    local left=$((BUDGET_S - ($(date +%s) - START)))
    if [ $needs_gpu -eq 1 ] && [ "$GPU" != 1 ]; then
        echo "== $name: skipped ($NO_GPU)"; record "$name" skipped 0 0 "$NO_GPU"; return 0
    fi
    if [ "$left" -lt "$estimate" ]; then
        local why="time budget: ${left} s left of ${BUDGET_S}, the step needs about ${estimate}"
        echo "== $name: skipped ($why)"; record "$name" skipped 0 0 "$why"; return 0
    fi
    local limit=$(( cap < left ? cap : left ))
    echo "== $name: $* (limit ${limit} s)"
    local t0; t0=$(date +%s.%N)
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    local took; took=$("$PY" -c "import sys; print(round($(date +%s.%N) - $t0, 1))")
    tail -n 15 "$OUT/$name.log"
    echo "== $name: exit $rc after ${took} s"
    local why=""
    [ $rc -eq 124 ] && why="timed out after ${limit} s"
    record "$name" "$([ $rc -eq 0 ] && echo ok || echo failed)" "$rc" "$took" "$why"
    [ $rc -ne 0 ] && [ $status -eq 0 ] && status=$rc
    return 0
}

step env 20 30 bash -c "nvidia-smi || true; $PY -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), \"tf32 matmul\", torch.backends.cuda.matmul.allow_tf32, \"cudnn\", torch.backends.cudnn.allow_tf32)'"
# The machine's torch is not this project's pin: build against it (no deps, nothing downloaded).
# An editable install, not build_ext alone: the built-in plugins are found through its entry points.
step build gpu 90 150 env DDPX_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS="$(nproc)" "$PY" -m pip install -q --no-deps \
    --no-build-isolation --no-index -e .
step tests_cuda gpu 60 120 "$PY" -m pytest -q -rs -p no:cacheprovider -m cuda tests/test_kernels.py tests/test_comm_hooks_cuda.py \
    tests/test_compile.py tests/test_comm_hook_threads.py
# trainer.strategy=fsdp on the device: the digits default sharded (3 units + the root), bf16 AMP
# (gathered and computed in bf16), a checkpoint of shards at each epoch end, the padded
# evaluation, the trained model in model/. World 1 over NCCL; 2 ranks on the one GPU over
# gloo (NCCL refuses two ranks on one device), which then resume from their shards for a
# third epoch (3 x 23 steps), and 2 ranks with the int8 reduce-scatter. Without a GPU the
# same runs on the CPU over gloo.
RUNS=$(mktemp -d)
DEV=$([ "$GPU" = 1 ] && echo cuda || echo cpu)
FSDP="$PY -m ddpx train trainer.strategy=fsdp fsdp.min_unit_params=1000 amp.enabled=true amp.dtype=bf16 \
logging.progress=false trainer.device=$DEV"
step fsdp_world1 25 90 bash -c "$FSDP --nproc-per-node 1 trainer.backend=$([ "$GPU" = 1 ] && echo nccl || echo gloo) \
    trainer.epochs=2 run_dir=$RUNS/world1 && test -s $RUNS/world1/model/model.safetensors && tail -n 1 $RUNS/world1/metrics.jsonl"
step fsdp_gloo_2ranks 45 150 bash -c "$FSDP --nproc-per-node 2 trainer.backend=gloo trainer.epochs=2 run_dir=$RUNS/gloo2 \
    && $FSDP --nproc-per-node 2 trainer.backend=gloo trainer.epochs=3 --resume $RUNS/gloo2 \
    && test -d $RUNS/gloo2/checkpoints/step-000000069.shards && tail -n 1 $RUNS/gloo2/metrics.jsonl"
# the int8 reduce-scatter (comm_hook.name=int8 under fsdp: ddpx's CUDA kernels, one all_to_all)
step fsdp_int8_2ranks 25 90 bash -c "$FSDP --nproc-per-node 2 trainer.backend=gloo comm_hook.name=int8 trainer.epochs=2 \
    run_dir=$RUNS/int8 && tail -n 1 $RUNS/int8/metrics.jsonl"
# Model parallelism on the device: the char GPT example as a 2-stage pipeline (2 ranks on the
# one GPU over gloo: NCCL refuses two ranks on one device; gloo's point-to-point transfers of
# CUDA activations are part of what this checks), fp32 and 8 steps, its losses against ddp on
# 1 rank (they matched to 1.2e-7 on the CPU); the interleaved schedule with bf16 AMP (the
# example's); and trainer.strategy=tensor with tensor.size=2 (ddpx/strategies/tensor.py).
# Each writes the whole model to model/. Without a GPU the same runs on the CPU.
MP="$PY -m ddpx train examples/char_gpt/config.yaml comm_hook.name=allreduce comm_hook.options={} model.args.dropout=0.0 \
trainer.max_steps=8 scheduler.args.total_steps=8 accumulation.steps=1 logging.progress=false logging.every_steps=1 \
trainer.device=$DEV trainer.backend=gloo"
same_loss() {  # same_loss RUN_A RUN_B: their last logged step losses agree to 1e-3 (relative)
    "$PY" - "$1" "$2" <<'EOF'
import json, sys
last = lambda run: [r for r in map(json.loads, open(run + "/metrics.jsonl")) if r.get("kind") == "step"][-1]
a, b = last(sys.argv[1]), last(sys.argv[2])
print(f"step {a['step']} loss: {sys.argv[1]} {a['loss']}, step {b['step']}: {sys.argv[2]} {b['loss']}, difference {abs(a['loss'] - b['loss']):.3g}")
sys.exit(int(a["step"] != b["step"] or abs(a["loss"] - b["loss"]) > 1e-3 * abs(a["loss"])))
EOF
}
export -f same_loss; export PY
step pipeline_vs_ddp 50 120 bash -c "$MP amp.enabled=false --nproc-per-node 1 run_dir=$RUNS/mp_ddp \
    && $MP amp.enabled=false trainer.strategy=pipeline pipeline.stages=2 --nproc-per-node 2 run_dir=$RUNS/mp_pipeline \
    && test -s $RUNS/mp_pipeline/model/model.safetensors && same_loss $RUNS/mp_ddp $RUNS/mp_pipeline"
step pipeline_interleaved 25 90 bash -c "$MP trainer.strategy=pipeline pipeline.schedule=interleaved_1f1b pipeline.stages_per_rank=2 \
    --nproc-per-node 2 run_dir=$RUNS/mp_interleaved && test -s $RUNS/mp_interleaved/model/model.safetensors \
    && tail -n 1 $RUNS/mp_interleaved/metrics.jsonl"
step tensor_2ranks 25 90 bash -c "$MP trainer.strategy=tensor tensor.size=2 --nproc-per-node 2 run_dir=$RUNS/mp_tensor \
    && test -s $RUNS/mp_tensor/model/model.safetensors && tail -n 1 $RUNS/mp_tensor/metrics.jsonl"
if [ "$GPU" = 1 ]; then
    step char_gpt 200 260 "$PY" benchmarks/bench_char_gpt.py --device cuda --warmup 100 --steps 400 --timeout 120 \
        --variants none,int8,powersgd,compile,compile_int8 --logdir "$OUT" --out "$OUT/bench_char_gpt.json"
    step hooks_2ranks 45 120 "$PY" benchmarks/bench_comm_hooks_digits.py --device cuda --out "$OUT/bench_comm_hooks_digits.json"
else  # the scripts themselves, on the CPU, short
    step char_gpt 60 150 "$PY" benchmarks/bench_char_gpt.py --device cpu --warmup 2 --steps 4 --timeout 100 \
        --variants none,powersgd --logdir "$OUT" --out "$OUT/bench_char_gpt.json"
    step hooks_2ranks 30 150 "$PY" benchmarks/bench_comm_hooks_digits.py --device cpu --epochs 3 --out "$OUT/bench_comm_hooks_digits.json"
fi
step fast_lane 60 200 "$PY" -m pytest -q -p no:cacheprovider -m "not slow" tests
step orthogonalize gpu 15 60 "$PY" benchmarks/bench_orthogonalize.py --device cuda --out "$OUT/bench_orthogonalize.json"
# the profiler plugin on CUDA: CUDA activity in the trace and the memory timeline (profile.memory)
step profile_cuda gpu 40 90 bash -c "$PY -m ddpx train trainer.epochs=1 logging.progress=false profile.enabled=true \
    profile.memory=true run_dir=$OUT/profile_run && ls -l $OUT/profile_run/profile && test -s $OUT/profile_run/profile/memory_rank0.html"
# both sizes (1 GiB, 4 MiB) against the copy, and issue 32's targets: exit 1 names the kernels that miss them
step bench_kernels_cuda gpu 30 90 "$PY" benchmarks/bench_kernels.py --device cuda --sizes-mb 1024 4 --check --json \
    --out "$OUT/bench_kernels_cuda.json"
step bench_kernels_cpu 30 60 "$PY" benchmarks/bench_kernels.py --device cpu --json --out "$OUT/bench_kernels_cpu.json"

# The one JSON: steps, the test counts, the benchmarks' figures, the recompiles of the compile runs.
"$PY" - "$OUT" "$STEPS" "$GPU" "$(( $(date +%s) - START ))" "$status" "$RUNS" <<'EOF' | tee "$OUT/device_check.json"
import glob, json, os, re, sys
out, steps_file, gpu, seconds, status, runs = sys.argv[1:]
steps = [json.loads(line) for line in open(steps_file)]
for s in steps:  # pytest's summary line: "3 failed, 40 passed, 2 skipped in 12.3s"
    log = os.path.join(out, s["step"] + ".log")
    if s["step"].startswith(("tests", "fast_lane")) and os.path.exists(log):
        lines = [l for l in open(log, errors="replace") if re.search(r"\d+ (passed|failed|error)", l)]
        if lines:
            s["summary"] = lines[-1].strip().strip("=").strip()
def load(name):
    path = os.path.join(out, name)
    try:
        return json.load(open(path))
    except (OSError, ValueError):
        return None
char_gpt = load("bench_char_gpt.json")
hooks = load("bench_comm_hooks_digits.json")
recompiles = {}
for log in sorted(glob.glob(os.path.join(out, "char_gpt_compile*.log"))):
    lines = [l.rstrip() for l in open(log, errors="replace") if "Recompiling" in l or "triggered by" in l]
    recompiles[os.path.basename(log)] = lines[:20]
fsdp_runs = {}  # each fsdp run's last epoch line (loss, eval_loss, accuracy)
for name in ("world1", "gloo2", "int8"):
    try:
        fsdp_runs[name] = [json.loads(l) for l in open(os.path.join(runs, name, "metrics.jsonl"))][-1]
    except (OSError, ValueError, IndexError):
        fsdp_runs[name] = None
model_parallel = {}  # each model-parallel run's last line
for name in ("mp_ddp", "mp_pipeline", "mp_interleaved", "mp_tensor"):
    try:
        model_parallel[name] = [json.loads(l) for l in open(os.path.join(runs, name, "metrics.jsonl"))][-1]
    except (OSError, ValueError, IndexError):
        model_parallel[name] = None
report = {
    "device_check": "gpu" if gpu == "1" else "dry-run (no GPU: GPU steps skipped, benchmark scripts run short on the CPU)",
    "seconds": int(seconds), "exit": int(status), "steps": steps,
    "char_gpt": char_gpt and {"summary": char_gpt.get("summary"), "runs": char_gpt.get("runs")},
    "hooks_2ranks": hooks and {"ok": hooks.get("ok"), "verdicts": hooks.get("verdicts"), "results": hooks.get("results")},
    "recompiles": recompiles,
    "fsdp": fsdp_runs,
    "model_parallel": model_parallel,
    "orthogonalize": load("bench_orthogonalize.json"),
    "bench_kernels_cuda": "written" if load("bench_kernels_cuda.json") is not None else None,
}
print(json.dumps(report))
EOF
exit $status

"""Time from a worker's SIGKILL to training resumed, on one machine (target: < 10 s).

Runs ``ddpx train --max-restarts 1`` (the built-in digits run, 2 processes by
default, checkpoints every few steps) with this file as a plugin: at a chosen
step, local rank 1 records the time and SIGKILLs itself; torchrun restarts
the group and the new workers record when they started, joined the process
group (``ddpx_setup``), restored the checkpoint (``ddpx_train_start``) and
finished their first optimizer step. All times are wall clock on this
machine, measured from the kill:

* ``respawn_s``: the new workers' processes exist (torchrun noticed the
  death, stopped the survivors and started new workers);
* ``setup_s``: the process group is up again (imports + rendezvous);
* ``restored_s``: model built and checkpoint loaded;
* ``resumed_s``: the first optimizer step after the restart is done (the
  number the target is about).

Usage: python benchmarks/bench_restart.py [--nproc 2] [--reps 1] [--json]
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddpx import hookimpl

TARGET_S = 10.0
_marks = {}


def _process_start_time() -> float:
    """Wall-clock start of this process (from /proc; falls back to now)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


# --- the plugin half (runs inside the workers) ---------------------------------------------


@hookimpl
def ddpx_config_defaults():
    return {"restart_bench": {"record": "", "kill_step": 10}}


def _record(trainer, name):
    if trainer.rank == 0:
        path = trainer.config.section("restart_bench")["record"]
        with open(path, "a") as f:
            f.write(json.dumps({"event": name, "t": time.time(), "process_start": _process_start_time()}) + "\n")


def _restarted() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"


@hookimpl
def ddpx_setup(trainer):
    if _restarted():
        _record(trainer, "setup")


@hookimpl(trylast=True)  # after the checkpoint plugin restored
def ddpx_train_start(trainer):
    if _restarted():
        _record(trainer, "restored")


@hookimpl
def ddpx_batch_end(trainer, batch_index, loss, stepped):
    if _restarted():
        if not _marks.get("resumed"):
            _marks["resumed"] = True
            _record(trainer, "resumed")
        return
    if trainer.global_step == trainer.config.section("restart_bench")["kill_step"] and trainer.local_rank == 1:
        path = trainer.config.section("restart_bench")["record"]
        with open(path, "a") as f:
            f.write(json.dumps({"event": "kill", "t": time.time()}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)


# --- the driver half -----------------------------------------------------------------------


def run_once(nproc: int, workdir: Path, timeout: float) -> dict:
    record = workdir / "times.jsonl"
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]))
    cmd = [
        sys.executable, "-m", "ddpx", "train", f"--nproc-per-node={nproc}", "--max-restarts=1",
        f"run_dir={workdir / 'run'}", "trainer.epochs=2", "checkpoint.every_steps=5",
        "logging.progress=false", "plugins.enable=[bench_restart]", f"restart_bench.record={record}",
        "restart_bench.kill_step=12",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"training failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    events = {}
    for line in record.read_text().splitlines():
        item = json.loads(line)
        events.setdefault(item["event"], item)
    kill = events["kill"]["t"]
    return {
        "respawn_s": events["setup"]["process_start"] - kill,
        "setup_s": events["setup"]["t"] - kill,
        "restored_s": events["restored"]["t"] - kill,
        "resumed_s": events["resumed"]["t"] - kill,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=180.0, help="per run, seconds")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    runs = []
    for _ in range(args.reps):
        with tempfile.TemporaryDirectory() as tmp:
            runs.append(run_once(args.nproc, Path(tmp), args.timeout))
    result = {"nproc": args.nproc, "reps": args.reps}
    for key in runs[0]:
        result[key] = round(statistics.median(r[key] for r in runs), 2)
    result["target_s"] = TARGET_S
    result["within_target"] = result["resumed_s"] < TARGET_S
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>14}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

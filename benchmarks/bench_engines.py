"""ddpx in the engines users already run, on one machine, against ``ddpx train`` with 2
processes on the same config (the built-in digits run unless KEY=VALUE overrides say otherwise):

* Ray Train: ``TorchTrainer`` with 2 workers on a local Ray cluster, each calling ``ddpx.fit``
  in the process group Ray created (the recipe of docs/engines.md);
* Kubeflow Trainer: 2 "nodes", each ``ddpx train`` with no launch flags and a TrainJob's
  ``PET_NNODES=2 PET_NPROC_PER_NODE=1 PET_MASTER_ADDR=127.0.0.1 PET_MASTER_PORT PET_NODE_RANK``.

Reports each run's last-epoch metrics and wall time (``ddpx train`` and the PET launch: from
start to exit; Ray: ``init_s`` starting the local cluster, ``fit_s`` ``TorchTrainer.fit`` with
its workers' start) and whether each run's epoch records are those of ``ddpx train`` (same seed,
world size and gloo: they should be; exit 1 otherwise). The suite covers the same code paths
without Ray (tests/test_engines.py): a Ray run alone takes longer than the suite's budget allows.

Needs Ray: ``pip install 'ray[train]'``.

Usage: python benchmarks/bench_engines.py [--workers 2] [--json] [--out FILE] [KEY=VALUE ...]   # about 2 min on 2 cores
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchjson import emit

from ddpx.net import free_port

if importlib.util.find_spec("ray") is None:
    sys.exit("bench_engines.py needs Ray: pip install 'ray[train]'")

# --- the Ray Train recipe of docs/engines.md (tests/test_docs.py: the page shows this text) ---
import ray.train
from ray.train import Checkpoint, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import ddpx


def train_loop(cfg):
    # Ray started this worker and created its process group: ddpx trains in that group.
    metrics = ddpx.fit(cfg["config"], overrides=[*cfg["overrides"], f"run_dir={cfg['run_dir']}"])
    # Rank 0 hands Ray the run directory (checkpoints, metrics.jsonl) with the last epoch's metrics.
    rank0 = ray.train.get_context().get_world_rank() == 0
    ray.train.report(metrics[-1], checkpoint=Checkpoint.from_directory(cfg["run_dir"]) if rank0 else None)


def train_with_ray(config, overrides, run_dir, workers=2, use_gpu=False, storage_path=None):
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"config": config, "overrides": overrides, "run_dir": run_dir},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu),
        run_config=RunConfig(storage_path=storage_path),
    )
    return trainer.fit()  # .metrics: the last epoch's; .checkpoint.path: the run directory's copy
# --- end of the recipe ---


def epochs(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("kind") == "epoch"]


def ddpx_train(overrides: list[str], run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "ddpx", "train", *overrides, f"run_dir={run_dir}", "logging.progress=false"]


def run_ddpx_train(overrides: list[str], workers: int, run_dir: Path) -> float:
    start = time.perf_counter()
    subprocess.run(ddpx_train(["--nproc-per-node", str(workers), *overrides], run_dir), check=True,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def run_pet_nodes(overrides: list[str], nodes: int, run_dir: Path) -> float:
    """``nodes`` ``ddpx train`` on this machine, configured as a TrainJob's pods are: PET_* only."""
    pet = {"PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": "1", "PET_MASTER_ADDR": "127.0.0.1",
           "PET_MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1"}  # the nodes share this machine's cores, as ddpx train's processes do
    start = time.perf_counter()
    procs = [subprocess.Popen(ddpx_train(overrides, run_dir), stdout=subprocess.DEVNULL,
                              env={**os.environ, **pet, "PET_NODE_RANK": str(node)}) for node in range(nodes)]
    codes = [proc.wait() for proc in procs]
    if any(codes):
        raise SystemExit(f"the PET_* launch failed: exit codes {codes}")
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="Ray workers, PET_* nodes (of 1 process) and ddpx train processes (default 2)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON line")
    parser.add_argument("--out", default=None, help="also write the report to this JSON file")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE overrides of the digits default, for both runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
        tmp = Path(tmp)
        ddpx_train_s = run_ddpx_train(args.overrides, args.workers, tmp / "ddpx-train")
        pet_s = run_pet_nodes(args.overrides, args.workers, tmp / "pet")
        start = time.perf_counter()
        ray.init(num_cpus=args.workers, include_dashboard=False)
        ray_init_s = time.perf_counter() - start
        start = time.perf_counter()
        result = train_with_ray(None, [*args.overrides, "logging.progress=false"], str(tmp / "ray"),
                                workers=args.workers, storage_path=str(tmp / "ray-results"))
        ray_fit_s = time.perf_counter() - start
        ray.shutdown()
        reference, pet, on_ray = epochs(tmp / "ddpx-train"), epochs(tmp / "pet"), epochs(Path(result.checkpoint.path))
    report = {
        "benchmark": "engines", "workers": args.workers, "overrides": args.overrides,
        "ray_version": ray.__version__, "cpus": os.cpu_count(), "load_average": os.getloadavg()[0],
        "ddpx_train": {"last_epoch": reference[-1], "wall_s": round(ddpx_train_s, 1)},
        "pet_launch": {"last_epoch": pet[-1], "wall_s": round(pet_s, 1), "same_epochs": pet == reference},
        "ray_train": {"last_epoch": on_ray[-1], "reported": {k: result.metrics[k] for k in ("loss", "accuracy")},
                      "init_s": round(ray_init_s, 1), "fit_s": round(ray_fit_s, 1), "same_epochs": on_ray == reference},
    }
    if not emit(report, args.out, args.json):
        for name, key in (("ddpx train", "ddpx_train"), ("PET_* launch", "pet_launch"), ("Ray Train", "ray_train")):
            run = report[key]
            last = run["last_epoch"]
            took = f"{run['wall_s']} s" if "wall_s" in run else f"{run['fit_s']} s (+ {run['init_s']} s ray.init)"
            same = "" if key == "ddpx_train" else f"  epochs as ddpx train's: {run['same_epochs']}"
            print(f"{name:<13} epoch {last['epoch']} step {last['step']}: loss {last['loss']:.4f} "
                  f"accuracy {last.get('accuracy', float('nan')):.4f}  {took}{same}")
    return 0 if report["pet_launch"]["same_epochs"] and report["ray_train"]["same_epochs"] else 1


if __name__ == "__main__":
    sys.exit(main())

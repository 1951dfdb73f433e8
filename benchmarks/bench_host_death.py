"""Elastic membership across hosts: time from a host's death to training again (target: < 15 s).

Two network-namespace "hosts" (tests/harness.two_hosts; root and `ip netns`
needed) each run ``ddpx train --nnodes 1:2 --max-restarts 3 --rdzv-endpoint
HOST0:PORT`` with one worker, the README's elastic command. At a chosen step
host 1's agent and worker are SIGKILLed (tests/elastic_probe.py,
``action: kill_node``). Host 0 goes on alone from the last checkpoint; when it
trains again, host 1 is started again (after ``--rejoin-after`` seconds) and
is admitted at the next rendezvous. Times, wall clock from the kill:

* ``death_to_training_s``: the survivor's first optimizer step at world size 1
  (the figure the target is about);
* ``rejoin_to_training_s``: from host 1's new start to the first step at world
  size 2 again.

Usage: python benchmarks/bench_host_death.py [--reps 1] [--json]
(``DDPX_TEST_NETNS=NSPREFIX,VETHPREFIX,A.B`` names the namespaces, as for the tests).
"""

from __future__ import annotations

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

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))
import harness  # noqa: E402  (tests/harness.py: two_hosts, free_port)

TARGET_S = 15.0
KILL_STEP = 30  # mid epoch 1 at world size 2 (23 steps per epoch), 2 steps after a checkpoint


def node_command(workdir: Path, endpoint: str, label: str, *extra: str, epochs: int = 6) -> list[str]:
    return [
        sys.executable, "-m", "ddpx", "train", "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "3",
        "--rdzv-endpoint", endpoint, f"run_dir={workdir / 'run'}", f"trainer.epochs={epochs}",
        "optimizer.args.lr=0.1", "checkpoint.every_steps=4", "logging.progress=false",
        "plugins.enable=[elastic_probe]", f"probe.record_dir={workdir / 'records'}", f"probe.label={label}",
        f"probe.marker={workdir / 'marker'}", "probe.step_sleep_s=0.1", *extra,
    ]


def groups(records_dir: Path) -> list[dict]:
    """The worker groups in order: ``{"start_step", "world_size", "steps": [records of every rank]}``.
    A file holds one agent's attempt; an agent restarted for a new member keeps its attempt
    number, so a file may hold several groups, each opened by a "start" record."""
    found: dict = {}
    for path in sorted(records_dir.glob("steps-*.jsonl")):
        current = None
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["event"] == "start":
                key = (record["step"], record["world_size"])
                current = found.setdefault(key, {"start_step": record["step"], "world_size": record["world_size"],
                                                 "steps": []})
            else:
                current["steps"].append(record)
    ordered = sorted(found.values(), key=lambda g: min((r["time"] for r in g["steps"]), default=float("inf")))
    return ordered


def run_scenario(workdir: Path, hosts, rejoin_after: float = 3.0, timeout: float = 240.0) -> dict:
    """Run the scenario on ``hosts`` (from harness.two_hosts); return exit codes, logs and times."""
    (workdir / "records").mkdir(parents=True, exist_ok=True)
    (host0, _, addr0), (host1, _, _) = hosts
    endpoint = f"{addr0}:{harness.free_port()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(name, None)  # ddpx chooses them

    def start(ns, name, *extra):
        log = open(workdir / f"{name}.log", "w")
        cmd = ["ip", "netns", "exec", ns, *node_command(workdir, endpoint, name, *extra)]
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
                                start_new_session=True)

    deadline = time.monotonic() + timeout
    procs = {"host0": start(host0, "host0")}
    procs["host1"] = start(host1, "host1", "probe.action=kill_node", "probe.rank=-1", f"probe.at_step={KILL_STEP}")
    rejoined_at = None
    try:
        while not (workdir / "marker").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        procs["host1"].wait(timeout=max(1.0, deadline - time.monotonic()))
        # host 1 comes back once the survivor trains alone
        while time.monotonic() < deadline and not any(g["world_size"] == 1 and g["steps"] for g in groups(workdir / "records")):
            time.sleep(0.2)
        time.sleep(rejoin_after)
        rejoined_at = time.time()
        procs["host1-again"] = start(host1, "host1-again")
        for proc in procs.values():
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    found = groups(workdir / "records")
    killed_at = (workdir / "marker").stat().st_mtime if (workdir / "marker").exists() else None
    alone = next((g for g in found if g["world_size"] == 1 and g["steps"]), None)
    again = next((g for g in found if alone and g["world_size"] == 2 and g["start_step"] > alone["start_step"]), None)
    return {
        "exit_codes": {name: proc.returncode for name, proc in procs.items()},
        "world_sizes": [g["world_size"] for g in found],
        "start_steps": [g["start_step"] for g in found],
        "death_to_training_s": round(min(r["time"] for r in alone["steps"]) - killed_at, 2)
        if alone and killed_at else None,
        "rejoin_to_training_s": round(min(r["time"] for r in again["steps"]) - rejoined_at, 2)
        if again and again["steps"] and rejoined_at else None,
        "logs": {name: (workdir / f"{name}.log").read_text() for name in procs},
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--rejoin-after", type=float, default=3.0, help="seconds the survivor trains alone")
    parser.add_argument("--timeout", type=float, default=240.0, help="per run, seconds")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if not harness.netns_available():
        raise SystemExit("bench_host_death: needs root and `ip netns` (network namespaces as hosts)")
    runs = []
    for _ in range(args.reps):
        with tempfile.TemporaryDirectory() as tmp, harness.two_hosts() as hosts:
            run = run_scenario(Path(tmp), hosts, args.rejoin_after, args.timeout)
        if run["death_to_training_s"] is None or set(run["exit_codes"].values()) - {0, -signal.SIGKILL}:
            tail = {name: log[-2000:] for name, log in run["logs"].items()}
            raise SystemExit(f"bench_host_death: the scenario failed: {run['exit_codes']} {json.dumps(tail, indent=1)}")
        runs.append(run)
    result = {"reps": args.reps, "world_sizes": runs[0]["world_sizes"]}
    for key in ("death_to_training_s", "rejoin_to_training_s"):
        values = [r[key] for r in runs if r[key] is not None]
        result[key] = round(statistics.median(values), 2) if values else None
        result[key.replace("_s", "_all_s")] = [r[key] for r in runs]
    result["target_s"] = TARGET_S
    result["within_target"] = result["death_to_training_s"] < TARGET_S
    result["load_average"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>24}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

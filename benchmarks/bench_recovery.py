"""What a host's death costs: live recovery (``elastic.recovery: live``) against today's elastic restart.

Three network-namespace "hosts" joined by a switch (tests/harness.hosts: a bridge in a namespace of
its own, one veth per host; root and ``ip netns`` needed), ``--nproc-per-node`` ranks each, the
digits default (or ``--example char_gpt``). Host 2 dies (SIGKILL of its whole process tree, agent
and workers, as a host dying) ``--failures`` times; each time, once it is dead and the others
train without it, it is started again with the same command, as an operator (or a scheduler)
would.

``--recovery live``: ``ddpx lighthouse --port PORT --heartbeat-timeout-s 1 --join-timeout-s 60`` on
host 0 (the join timeout given: without it three groups never share a quorum, docs/recovery.md), then on
every host the README's live command ``ddpx train --nproc-per-node N --lighthouse HOST0:PORT``, with
the test plugin tests/live_faults.py recording every committed step (wall time, replica groups)
and a "ready" record when training starts. Per failure:

* ``stall_death_s``: the survivors' largest gap between consecutive committed steps from their last
  step before the kill to their first step without host 2 (``since_commit_s``: the same, as the
  membership line "3 -> 2 replica groups ... (X s since the last committed step; N step(s)
  dropped)" says it);
* ``stall_rejoin_s``: the survivors' largest gap around host 2's first committed step after its
  restart (the heal: the survivors send it their state);
* ``ready_to_first_step_s``: the restarted host's time from its "ready" record (its process is up,
  its model built) to its first committed step (quorum, heal);
* ``survivor_exited`` (must be false), ``checkpoint_read`` (a "resumed from" line in any log of
  the run; must be false);
* ``lost_s``: seconds of the survivors' training lost: both stalls less one ordinary step each, plus
  the dropped steps times the ordinary step time.

``--recovery restart``: the same hosts with ``ddpx train --nnodes 2:3 --max-restarts M
--rdzv-endpoint HOST0:PORT checkpoint.every_steps=C`` (the README's elastic command, as
bench_host_death.py) and tests/elastic_probe.py for the records. Per failure:

* ``death_to_training_s``: from the kill to the survivors' first step in their new worker group;
* ``redone_steps``: the steps the survivors had committed past the checkpoint they resumed from;
* ``rejoin_stall_s``, ``rejoin_redone_steps``: the same when host 2 comes back (every agent restarts
  its workers for the new member, from the last checkpoint);
* ``lost_s``: the survivors' two stalls less one ordinary step each, plus every redone step times
  the ordinary step time.

The final eval loss and accuracy are host 0's ("finished after ..." line). ``--seeds 0 1 2``: for
each seed one undisturbed live run and one disturbed one (the spread of the final accuracy and eval
loss).

Every step sleeps ``--step-sleep`` s (so a run outlasts its failures) until the last failure is
over; then the run ends at full speed.

Usage (root): python benchmarks/bench_recovery.py --recovery live|restart [--failures 10]
[--nproc-per-node 1] [--epochs 40] [--seeds 0 1 2] [--workdir DIR] [--json] [--out FILE] [KEY=VALUE ...]
(``DDPX_TEST_NETNS=NSPREFIX,VETHPREFIX,A.B`` names the namespaces, as for the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (tests/harness.py: hosts, free_port, process_tree)
from benchjson import emit  # noqa: E402

LIGHTHOUSE_PORT = 29510
HOSTS = 3
VICTIM = 2  # the host that dies

MEMBERSHIP = re.compile(r"replica group (?P<name>\S+): (?P<before>\d+) -> (?P<after>\d+) replica groups at step "
                        r"(?P<step>\d+) \((?P<since>[\d.]+) s since the last committed step; (?P<dropped>\d+) "
                        r"step\(s\) dropped\)")
RESUMED = "resumed from "
FINISHED = re.compile(r"finished after .*?; epoch (?P<epoch>\d+): (?P<values>.*?); run directory")


# --- pure helpers: records and log lines into per-failure numbers (tests/test_bench_recovery.py) ---

def read_jsonl(path: Path) -> list[dict]:
    """A records file, without a line a SIGKILL cut short."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def live_incarnations(records_dir: Path, label: str) -> list[dict]:
    """One host's processes under live recovery (tests/live_faults.py, one file per worker pid; rank 0's
    is the first written), in start order: ``{"ready": time, "steps": [committed step records]}``."""
    found = []
    for path in Path(records_dir).glob(f"{label}-*.jsonl"):
        records = read_jsonl(path)
        ready = next((r["time"] for r in records if r.get("event") == "ready"), None)
        steps = [r for r in records if "event" not in r]
        if ready is None and not steps:
            continue
        found.append({"ready": ready, "steps": steps, "path": str(path)})
    found.sort(key=lambda inc: inc["ready"] if inc["ready"] is not None else inc["steps"][0]["time"])
    # several ranks per host write a file each: keep one (the first) per start
    kept = []
    for inc in found:
        if kept and inc["ready"] is not None and kept[-1]["ready"] is not None and \
                abs(inc["ready"] - kept[-1]["ready"]) < 5.0 and _same_steps(inc, kept[-1]):
            continue
        kept.append(inc)
    return kept


def _same_steps(a: dict, b: dict) -> bool:
    return [r["step"] for r in a["steps"]][:3] == [r["step"] for r in b["steps"]][:3]


def restart_groups(records_dir: Path, label: str) -> list[dict]:
    """One host's worker groups under elastic restart (tests/elastic_probe.py: a file per attempt and
    global rank), in start order: ``{"start": time, "start_step", "world_size", "steps": [step
    records]}``; a file may hold several groups (an agent restarted for a new member keeps its attempt
    number). Of a host's several ranks, one group per start (the rank's that wrote first)."""
    groups = []
    for path in sorted(Path(records_dir).glob(f"steps-{label}-*-rank*.jsonl")):
        current = None
        for record in read_jsonl(path):
            if record["event"] == "start":
                current = {"start": record.get("time"), "start_step": record["step"],
                           "world_size": record["world_size"], "steps": []}
                groups.append(current)
            elif current is not None:
                current["steps"].append(record)
    groups.sort(key=lambda g: g["start"] if g["start"] is not None else
                min((r["time"] for r in g["steps"]), default=float("inf")))
    kept = []
    for g in groups:
        if kept and (g["start_step"], g["world_size"]) == (kept[-1]["start_step"], kept[-1]["world_size"]) and \
                g["start"] is not None and kept[-1]["start"] is not None and g["start"] - kept[-1]["start"] < 5.0:
            continue  # another rank of the same host and group
        kept.append(g)
    return kept


def membership_changes(log: str) -> list[dict]:
    """The "N -> M replica groups" lines of a group's log, in order."""
    return [{"before": int(m["before"]), "after": int(m["after"]), "step": int(m["step"]),
             "since_commit_s": float(m["since"]), "dropped": int(m["dropped"])} for m in MEMBERSHIP.finditer(log)]


def final_metrics(log: str) -> dict | None:
    """The last epoch's metrics of the "finished after" line: ``{"epoch", "accuracy", "val_loss", ...}``."""
    m = None
    for m in FINISHED.finditer(log):
        pass
    if m is None:
        return None
    values = {"epoch": int(m["epoch"])}
    parts = m["values"].split()
    for key, value in zip(parts[::2], parts[1::2]):
        try:
            values[key] = float(value)
        except ValueError:
            values[key] = value
    return values


def step_time(times: list[float]) -> float | None:
    """The ordinary step time: the median gap between consecutive committed steps."""
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else None


def gap_around(times: list[float], at: float, until: float | None = None) -> float | None:
    """The largest gap between consecutive times from the last one before ``at`` up to the first one
    after ``until`` (default ``at``)."""
    times = sorted(times)
    until = at if until is None else until
    before = [i for i, t in enumerate(times) if t <= at]
    after = [i for i, t in enumerate(times) if t > until]
    if not before or not after:
        return None
    span = times[before[-1]:after[0] + 1]
    return max(b - a for a, b in zip(span, span[1:]))


def ordinary_step(times: list[float], at: float, count: int = 20) -> float:
    """The step time before ``at``: the median gap of the last ``count`` steps before it."""
    before = [t for t in sorted(times) if t <= at][-count:]
    return step_time(before) or 0.0


def live_failures(kills: list[dict], survivors: dict[str, list[dict]], victim: list[dict],
                  changes: dict[str, list[dict]]) -> list[dict]:
    """Per failure, from the benchmark's ``kills`` (``{"killed": time, "restarted": time}``), each
    survivor's committed steps (one list of step records per survivor), the victim's incarnations
    (:func:`live_incarnations`) and each survivor's membership lines (:func:`membership_changes`)."""
    out = []
    for i, kill in enumerate(kills):
        again = next((inc for inc in victim if inc["ready"] is not None and inc["ready"] >= kill["restarted"]), None)
        first = again["steps"][0]["time"] if again and again["steps"] else None
        row = {"failure": i + 1, "ready_to_first_step_s": round(first - again["ready"], 2) if first else None}
        stalls, rejoins, lost, since, dropped, ordinaries = [], [], [], [], [], []
        for name, steps in survivors.items():
            times = [r["time"] for r in steps]
            ordinary = ordinary_step(times, kill["killed"])
            ordinaries.append(ordinary)
            # the first step without the victim: fewer groups than before, after the kill
            alone = next((r["time"] for r in steps if r["time"] > kill["killed"] and r["groups"] < HOSTS), None)
            stall = gap_around(times, kill["killed"], alone) if alone else None
            # from the restart to the victim's first committed step: its join and heal
            rejoin = gap_around(times, kill["restarted"], first) if first else None
            down = [c for c in changes.get(name, []) if c["before"] == HOSTS and c["after"] == HOSTS - 1]
            change = down[i] if i < len(down) else None
            stalls.append(stall)
            rejoins.append(rejoin)
            since.append(change["since_commit_s"] if change else None)
            dropped.append(change["dropped"] if change else 0)
            if stall is not None:
                lost.append(max(0.0, stall - ordinary) + max(0.0, (rejoin or ordinary) - ordinary)
                            + (change["dropped"] if change else 0) * ordinary)
        row.update(stall_death_s=_max(stalls), since_commit_s=_max(since), dropped_steps=max(dropped, default=0),
                   stall_rejoin_s=_max(rejoins), step_s=_max(ordinaries), lost_s=_max(lost))
        out.append(row)
    return out


def restart_failures(kills: list[dict], survivor: list[dict]) -> list[dict]:
    """Per failure under elastic restart, from the kills and one survivor's worker groups
    (:func:`restart_groups`)."""
    out = []
    steps = [r for g in survivor for r in g["steps"]]
    for i, kill in enumerate(kills):
        ordinary = ordinary_step([r["time"] for g in survivor for r in g["steps"][1:]], kill["killed"])
        before = [g for g in survivor if g["start"] is not None and g["start"] < kill["killed"]]
        after = [g for g in survivor if g["start"] is not None and g["start"] > kill["killed"] and g["steps"]]
        row = {"failure": i + 1, "step_s": round(ordinary, 3)}
        if not before or not after:
            out.append(row)
            continue
        last = max((r for r in steps if r["time"] <= kill["killed"]), key=lambda r: r["time"], default=None)
        down = after[0]
        row["death_to_training_s"] = round(down["steps"][0]["time"] - kill["killed"], 2)
        row["death_stall_s"] = round(down["steps"][0]["time"] - last["time"], 2) if last else None
        row["redone_steps"] = max(0, last["step"] - down["start_step"]) if last else 0
        up = next((g for g in after[1:] if g["start"] >= kill["restarted"] and g["world_size"] > down["world_size"]),
                  None)
        if up and up["steps"]:
            prev = max((r for r in steps if r["time"] < up["start"]), key=lambda r: r["time"])
            row["rejoin_stall_s"] = round(up["steps"][0]["time"] - prev["time"], 2)
            row["rejoin_redone_steps"] = max(0, prev["step"] - up["start_step"])
        stalls = [row.get("death_stall_s"), row.get("rejoin_stall_s")]
        row["lost_s"] = round(sum(max(0.0, s - ordinary) for s in stalls if s is not None)
                              + (row["redone_steps"] + row.get("rejoin_redone_steps", 0)) * ordinary, 2)
        out.append(row)
    return out


def _max(values):
    values = [v for v in values if v is not None]
    return round(max(values), 2) if values else None


def summary(rows: list[dict], keys) -> dict:
    """Median and range of each key over the failures."""
    out = {}
    for key in keys:
        values = [r[key] for r in rows if r.get(key) is not None]
        if values:
            out[key] = {"median": round(statistics.median(values), 2), "min": round(min(values), 2),
                        "max": round(max(values), 2)}
    return out


# --- running the scenarios (root) -------------------------------------------------------------

class Hosts:
    """The processes of one scenario on the namespace hosts."""

    def __init__(self, workdir: Path, hosts):
        self.workdir, self.hosts, self.procs, self.logs = workdir, hosts, {}, {}
        self.env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "plugins"), str(TESTS),
                                                    os.environ.get("PYTHONPATH", "")]))
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            self.env.pop(name, None)  # ddpx chooses them

    def start(self, host: int, name: str, args: list[str]) -> subprocess.Popen:
        log = self.workdir / f"{name}.log"
        self.logs[name] = log
        with open(log, "w") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", self.hosts[host][0], sys.executable, "-m", "ddpx", *args],
                                    env=self.env, stdout=out, stderr=subprocess.STDOUT, cwd=self.workdir,
                                    start_new_session=True)
        self.procs[name] = proc
        return proc

    def kill(self, name: str) -> float:
        """SIGKILL the process tree of ``name`` (agent and workers: a host dying); the wall time."""
        tree = harness.process_tree(self.procs[name].pid)
        for pid in tree:  # frozen first: no agent sees a worker die
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        killed = time.time()
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.procs[name].wait()
        return killed

    def log(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")

    def stop_all(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                for pid in harness.process_tree(proc.pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                proc.wait()


def wait(condition, seconds: float, poll: float = 0.1):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    return None


def train_args(args, seed: int) -> list[str]:
    config = [str(ROOT / "examples" / "char_gpt" / "config.yaml")] if args.example == "char_gpt" else []
    return [*config, "--nproc-per-node", str(args.nproc_per_node), f"trainer.epochs={args.epochs}", f"seed={seed}",
            "logging.progress=false", *args.overrides]


def join_timeout(args) -> list[str]:
    """``--join-timeout-s`` for the Lighthouse, where this benchmark is given one (else ``ddpx lighthouse``'s
    default, 60 s, which it passes to torchft explicitly: docs/recovery.md)."""
    return [] if args.join_timeout_s is None else ["--join-timeout-s", f"{args.join_timeout_s:g}"]


def run_live(args, workdir: Path, hosts, failures: int, seed: int = 0) -> dict:
    records = workdir / "records"
    records.mkdir(parents=True, exist_ok=True)
    run = Hosts(workdir, hosts)
    lighthouse = f"{hosts[0][2]}:{LIGHTHOUSE_PORT}"
    kills = []

    def host_args(i):
        return ["train", *train_args(args, seed), "--lighthouse", lighthouse, f"run_dir={workdir / f'run{i}'}",
                "plugins.enable=[live_faults]", f"faults.record_dir={records}", f"faults.label=host{i}",
                f"faults.step_sleep_s={args.step_sleep}", f"faults.fast_file={workdir / 'fast'}"]

    def steps(label):
        return [r for inc in live_incarnations(records, label) for r in inc["steps"]]

    def trained_with_all(since):
        """The victim's process started after ``since`` committed ``steps_between`` steps with every host."""
        incs = [inc for inc in live_incarnations(records, f"host{VICTIM}") if (inc["ready"] or 0) >= since]
        return incs and sum(r["groups"] == HOSTS for r in incs[-1]["steps"]) >= args.steps_between

    started = time.monotonic()
    try:
        run.start(0, "lighthouse", ["lighthouse", "--port", str(LIGHTHOUSE_PORT), "--min-groups", str(args.min_groups),
                                    "--heartbeat-timeout-s", "1", *join_timeout(args)])
        if not failures:
            (workdir / "fast").touch()
        for i in range(HOSTS):
            run.start(i, f"host{i}", host_args(i))
        name, since = f"host{VICTIM}", 0.0
        for k in range(failures + 1):
            # the victim (restarted) trains with every host for a few steps
            ok = wait(lambda: trained_with_all(since), args.timeout)
            if k == failures or not ok or any(run.procs[f"host{i}"].poll() is not None for i in range(VICTIM)):
                break
            kill = {"killed": run.kill(name)}
            wait(lambda: any(r["time"] > kill["killed"] and r["groups"] < HOSTS for r in steps("host0")), 60)
            time.sleep(args.restart_after)
            kill["restarted"] = since = time.time()
            kills.append(kill)
            name = f"host{VICTIM}-{k + 1}"
            run.start(VICTIM, name, host_args(VICTIM))
        (workdir / "fast").touch()  # the failures are over: the run ends at full speed
        for proc in run.procs.values():
            if proc is not run.procs["lighthouse"]:
                proc.wait(timeout=max(1.0, args.timeout - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        pass
    finally:
        if run.procs["lighthouse"].poll() is None:
            run.procs["lighthouse"].terminate()
            try:
                run.procs["lighthouse"].wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        exit_codes = {n: p.poll() for n, p in run.procs.items()}
        run.stop_all()
    survivors = {f"host{i}": steps(f"host{i}") for i in range(VICTIM)}
    victim = [inc for inc in live_incarnations(records, f"host{VICTIM}")]
    changes = {f"host{i}": membership_changes(run.log(f"host{i}")) for i in range(VICTIM)}
    rows = live_failures(kills, survivors, victim, changes)
    logs = {n: run.log(n) for n in run.logs}
    return {
        "recovery": "live", "seed": seed, "failures": rows,
        "exit_codes": exit_codes,
        "survivor_exited": any(exit_codes[f"host{i}"] != 0 for i in range(VICTIM)),
        "checkpoint_read": {"survivors": any(RESUMED in logs[f"host{i}"] for i in range(VICTIM)),
                            "restarted_host": [n for n, log in logs.items() if n.startswith(f"host{VICTIM}-") and
                                               RESUMED in log]},
        "healed_lines": sum(log.count("healed from a peer") for log in logs.values()),
        "final": {f"host{i}": final_metrics(logs[f"host{i}"]) for i in range(VICTIM)},
        "seconds": round(time.monotonic() - started, 1),
        "log_tails": {n: log[-1500:] for n, log in logs.items()},
    }


def run_restart(args, workdir: Path, hosts, failures: int, seed: int = 0) -> dict:
    records = workdir / "records"
    records.mkdir(parents=True, exist_ok=True)
    run = Hosts(workdir, hosts)
    endpoint = f"{hosts[0][2]}:{harness.free_port()}"
    kills = []

    def host_args(i):
        return ["train", *train_args(args, seed), "--nnodes", f"{HOSTS - 1}:{HOSTS}", "--max-restarts",
                str(2 * failures + 3), "--rdzv-endpoint", endpoint, f"run_dir={workdir / 'run'}",
                f"checkpoint.every_steps={args.every_steps}", "plugins.enable=[elastic_probe]",
                f"probe.record_dir={records}", f"probe.label=host{i}", f"probe.step_sleep_s={args.step_sleep}",
                f"probe.fast_file={workdir / 'fast'}"]

    started = time.monotonic()
    try:
        for i in range(HOSTS):
            run.start(i, f"host{i}", host_args(i))
        name, since = f"host{VICTIM}", 0.0

        def victim_trained():
            groups = [g for g in restart_groups(records, f"host{VICTIM}") if (g["start"] or 0) >= since]
            return groups and groups[-1]["world_size"] == HOSTS * args.nproc_per_node and \
                len(groups[-1]["steps"]) >= args.steps_between and run.procs[name].poll() is None

        for k in range(failures + 1):
            if not wait(victim_trained, args.timeout) or k == failures:
                break
            kill = {"killed": run.kill(name)}
            wait(lambda: any(g["start"] and g["start"] > kill["killed"] and g["steps"]
                             for g in restart_groups(records, "host0")), 120)
            time.sleep(args.restart_after)
            kill["restarted"] = since = time.time()
            kills.append(kill)
            name = f"host{VICTIM}-{k + 1}"
            run.start(VICTIM, name, host_args(VICTIM))
        (workdir / "fast").touch()
        for proc in run.procs.values():
            proc.wait(timeout=max(1.0, args.timeout - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        pass
    finally:
        exit_codes = {n: p.poll() for n, p in run.procs.items()}
        run.stop_all()
    survivor = restart_groups(records, "host0")
    rows = restart_failures(kills, survivor)
    logs = {n: run.log(n) for n in run.logs}
    return {
        "recovery": "restart", "seed": seed, "failures": rows, "exit_codes": exit_codes,
        "checkpoint_read": any(RESUMED in log for log in logs.values()),
        "world_sizes": [g["world_size"] for g in survivor],
        "final": {"host0": final_metrics(logs["host0"])},
        "seconds": round(time.monotonic() - started, 1),
        "log_tails": {n: log[-1500:] for n, log in logs.items()},
    }


KEYS = {"live": ["lost_s", "stall_death_s", "since_commit_s", "stall_rejoin_s", "ready_to_first_step_s",
                 "dropped_steps", "step_s"],
        "restart": ["lost_s", "death_to_training_s", "death_stall_s", "redone_steps", "rejoin_stall_s",
                    "rejoin_redone_steps", "step_s"]}


def one_run(args, recovery: str, failures: int, seed: int) -> dict:
    runner = run_live if recovery == "live" else run_restart
    with tempfile.TemporaryDirectory(prefix="bench_recovery") as tmp, harness.hosts(HOSTS) as hosts:
        workdir = Path(args.workdir) / f"{recovery}-seed{seed}-failures{failures}" if args.workdir else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        result = runner(args, workdir, hosts, failures, seed)
    if not args.keep_logs:
        result.pop("log_tails")
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recovery", choices=["live", "restart"], default="live")
    parser.add_argument("--failures", type=int, default=10, help="times host 2 dies")
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--min-groups", type=int, default=1, help="live: the Lighthouse's --min-groups")
    parser.add_argument("--join-timeout-s", type=float, default=60.0,
                        help="live: the Lighthouse's --join-timeout-s (-1: not given, ddpx lighthouse's default)")
    parser.add_argument("--example", choices=["digits", "char_gpt"], default="digits")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--step-sleep", type=float, default=0.15, help="seconds each step sleeps (the pace)")
    parser.add_argument("--steps-between", type=int, default=5, help="steps host 2 trains with all before it dies")
    parser.add_argument("--restart-after", type=float, default=1.0, help="seconds host 2 stays dead")
    parser.add_argument("--every-steps", type=int, default=10, help="checkpoint.every_steps under restart")
    parser.add_argument("--seeds", type=int, nargs="*", help="live only: an undisturbed and a disturbed run per seed")
    parser.add_argument("--timeout", type=float, default=600.0, help="per run, seconds")
    parser.add_argument("--keep-logs", action="store_true", help="the logs' tails in the result")
    parser.add_argument("--workdir", help="run in this directory and keep it (default: a temporary one)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", help="write the JSON result to this file")
    parser.add_argument("overrides", nargs="*", help="config overrides for every host (key=value)")
    args = parser.parse_args(argv)
    if args.join_timeout_s is not None and args.join_timeout_s < 0:
        args.join_timeout_s = None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`, kill: the hosts' namespaces go too
    if not harness.netns_available():
        raise SystemExit("bench_recovery: needs root and `ip netns` (network namespaces as hosts)")
    load = os.getloadavg()
    result = {"command": " ".join(["python", "benchmarks/bench_recovery.py", *sys.argv[1:]]) if argv is None else None,
              "recovery": args.recovery, "example": args.example, "nproc_per_node": args.nproc_per_node,
              "load_average_before": [round(x, 2) for x in load]}
    if args.seeds:
        runs = []
        for seed in args.seeds:
            for failures in (0, args.failures):
                run = one_run(args, "live", failures, seed)
                runs.append({"seed": seed, "failures": failures, "final": run["final"],
                             "survivor_exited": run["survivor_exited"], "checkpoint_read": run["checkpoint_read"],
                             "summary": summary(run["failures"], KEYS["live"])})
        result["seeds"] = runs
        for failures in (0, args.failures):
            finals = [r["final"]["host0"] for r in runs if r["failures"] == failures and r["final"]["host0"]]
            result[f"failures_{failures}"] = {key: [f.get(key) for f in finals] for key in ("accuracy", "eval_loss")}
    else:
        run = one_run(args, args.recovery, args.failures, 0)
        result.update(run)
        result["summary"] = summary(run["failures"], KEYS[args.recovery])
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    if not emit(result, args.out, args.json):
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Elastic restarts end to end: ``ddpx train`` through torchrun, gloo on CPU, hard timeouts.

The probe plugin (tests/elastic_probe.py) records the samples of every
optimizer step per rank and attempt and injects one failure. "Exactly once"
is judged on the training that survives: a step an attempt ran after the
checkpoint the next attempt resumed from is replayed by that attempt, so it
does not count (its records are dropped).
"""

import json
import os
import re
import signal
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import harness

TESTS = Path(__file__).resolve().parent
NUM_TRAIN = 1438  # digits_split(test_fraction=0.2): training samples
STEPS_PER_EPOCH = 23  # 2 ranks x 32 per rank: 22 full global batches + a tail
pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]


def train(ranks, tmp_path, label, *extra, nproc=2, max_restarts=0, timeout=90, run_dir=True):
    args = train_args(tmp_path, label, *extra, nproc=nproc, max_restarts=max_restarts, run_dir=run_dir)
    code, out, err = ranks.cli(args, timeout=timeout, env=probe_env(), cwd=tmp_path)
    return code, out + err


def probe_env():
    return {"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}


def train_args(tmp_path, label, *extra, nproc=2, max_restarts=0, run_dir=True):
    """``ddpx train`` arguments: 2 epochs with the probe recording into ``tmp_path/records``."""
    records = tmp_path / "records"
    records.mkdir(exist_ok=True)
    return [
        "train", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
        *([f"run_dir={tmp_path / 'run'}"] if run_dir else []), "trainer.epochs=2", "optimizer.args.lr=0.1",
        "checkpoint.every_steps=4", "logging.progress=false", "plugins.enable=[elastic_probe]",
        f"probe.record_dir={records}", f"probe.label={label}", f"probe.marker={tmp_path / 'marker'}",
        *extra,
    ]


def attempts(tmp_path, labels):
    """Per attempt (in order): ``(start_step, world_size, [step records of all ranks])``."""
    found = []
    for label in labels:
        attempt = 0
        while True:
            files = sorted((tmp_path / "records").glob(f"steps-{label}-{attempt}-rank*.jsonl"))
            if not files:
                break
            lines = [json.loads(line) for f in files for line in f.read_text().splitlines()]
            start = next(r for r in lines if r["event"] == "start")
            found.append((start["step"], start["world_size"], [r for r in lines if r["event"] == "step"]))
            attempt += 1
    return found


def committed_samples(tmp_path, labels):
    """``{epoch: Counter(sample index)}`` over the steps that survive in the final training."""
    runs = attempts(tmp_path, labels)
    seen = {}
    for i, (_, _, steps) in enumerate(runs):
        resumed_at = runs[i + 1][0] if i + 1 < len(runs) else None
        for record in steps:
            if resumed_at is None or record["step"] <= resumed_at:
                seen.setdefault(record["epoch"], Counter()).update(record["indices"])
    return seen, runs


def assert_each_sample_once(seen, epochs=(0, 1)):
    assert sorted(seen) == list(epochs)
    for epoch in epochs:
        counts = seen[epoch]
        duplicated = {i: c for i, c in counts.items() if c != 1}
        missing = set(range(NUM_TRAIN)) - set(counts)
        assert not duplicated and not missing, (
            f"epoch {epoch}: {len(duplicated)} samples seen more than once, {len(missing)} never"
        )


def final_accuracy(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if "accuracy" in line][-1]["accuracy"]


def test_sigkill_mid_epoch_restarts_and_matches_uninterrupted_run(ranks, tmp_path):
    """SIGKILL of a worker mid epoch 1, run_dir unset: the restarted workers resume from the
    newest checkpoint in the same ``runs/<UTC time>`` (chosen once per launch, not again by
    them), replay nothing twice, and end with the uninterrupted run's weights."""
    reference = tmp_path / "reference"
    reference.mkdir()
    code, log = train(ranks, reference, "ref")
    assert code == 0, log[-3000:]

    at_step = STEPS_PER_EPOCH + 7  # mid epoch 1, 3 steps after the checkpoint of step 28
    code, log = train(ranks, tmp_path, "kill", "probe.action=kill", f"probe.at_step={at_step}", "probe.rank=1",
                      max_restarts=2, run_dir=False)
    assert code == 0, log[-3000:]
    assert (tmp_path / "marker").exists(), "the probe never killed the worker"
    (run_dir,) = (tmp_path / "runs").iterdir()
    seen, runs = committed_samples(tmp_path, ["kill"])
    assert [r[0] for r in runs][0] == 0 and len(runs) == 2, runs
    # Resumed from the newest checkpoint before the kill (24 if the async write of 28 was still in flight).
    assert runs[1][0] in (24, 28), runs[1][0]
    assert f"resumed from {run_dir / 'checkpoints'}" in log, log[-3000:]
    assert any(r["step"] > runs[1][0] for r in runs[0][2]), "nothing was replayed: the test proves nothing"
    assert_each_sample_once(seen)

    expected = torch.load(reference / "records" / "final-ref.pt")
    actual = torch.load(tmp_path / "records" / "final-kill.pt")
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), f"{name} differs from the uninterrupted run"
    assert final_accuracy(run_dir) > 0.8  # chance: 0.1


def test_sigterm_stops_cleanly_and_resumes_with_another_world_size(ranks, tmp_path):
    at_step = STEPS_PER_EPOCH + 7
    code, log = train(ranks, tmp_path, "first", "probe.action=term_agent", f"probe.at_step={at_step}",
                      "probe.rank=0", "checkpoint.every_steps=0", "checkpoint.stop_check_every=5")
    assert code == 128 + signal.SIGTERM, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    code, log = train(ranks, tmp_path, "second", nproc=3)
    assert code == 0, log[-3000:]
    assert "resuming with 3 ranks from a checkpoint of 2" in log
    seen, runs = committed_samples(tmp_path, ["first", "second"])
    assert [(r[0], r[1]) for r in runs][0] == (0, 2)
    stopped_at, world = runs[1][0], runs[1][1]
    # Only epoch-end checkpoints were configured: this one is the stop's own, mid epoch 1.
    assert world == 3 and at_step <= stopped_at < 2 * STEPS_PER_EPOCH, runs[1][:2]
    assert_each_sample_once(seen)
    assert final_accuracy(tmp_path / "run") > 0.8  # chance: 0.1


def test_workers_stop_with_a_final_checkpoint_when_the_launcher_is_killed(ranks, tmp_path):
    """``kill -9`` of ``ddpx train`` (the OOM killer, a job's time limit): its workers, each in a
    session of its own under torchrun, stop within seconds with a final checkpoint instead of
    training on as orphans; a rerun resumes there and sees every sample once."""
    at_step = STEPS_PER_EPOCH + 7  # 0.2 s steps from the kill on: two 2-step checks end it well before step 46
    cmd = [sys.executable, "-m", "ddpx", *train_args(
        tmp_path, "first", "probe.action=kill_agent", f"probe.at_step={at_step}", "probe.rank=0",
        "probe.step_sleep_s=0.2", "checkpoint.every_steps=0", "checkpoint.stop_check_every=2")]
    (launcher,) = ranks.commands([cmd], tmp_path, timeout=90, env=probe_env(), cwd=tmp_path, names=["launcher"])
    assert launcher.returncode == -signal.SIGKILL, launcher.output[-3000:]
    workers = worker_pids(tmp_path, "first")
    assert len(workers) == 2
    assert harness.wait_for(lambda: not any(map(alive, workers)), 30, poll=0.1), \
        "the workers outlived their launcher by 30 s"
    log = (tmp_path / "launcher.log").read_text()  # the workers' output went on after the launcher's end
    console = (tmp_path / "run" / "console.log").read_text()  # and into the run's console.log
    for text in (log, console):
        for rank in (0, 1):
            assert re.search(rf"\[rank{rank}\] the launcher \(pid \d+\) is gone: stopping", text), text[-3000:]
            assert f"ddpx: [rank{rank}] stopped by signal SIGTERM" in text, text[-3000:]
    resume = next(line for line in console.splitlines() if line.startswith("ddpx: to resume this run: ddpx train "))
    assert resume.endswith(f" run_dir={tmp_path / 'run'}"), resume

    code, log = train(ranks, tmp_path, "second")
    assert code == 0, log[-3000:]
    seen, runs = committed_samples(tmp_path, ["first", "second"])
    stopped_at = runs[1][0]
    assert at_step < stopped_at < 2 * STEPS_PER_EPOCH, runs[1][:2]  # the stop's own checkpoint, mid epoch 1
    assert_each_sample_once(seen)


def test_a_job_still_running_at_the_test_deadline_prints_its_stacks_and_leaves_no_process(tmp_path):
    """The harness's promise on the shape that once hung CI without a word: a job running at
    the deadline is ended with every process torchrun started (each in a session of its own),
    after each one printed its threads' stacks into the log."""
    cmd = [sys.executable, "-m", "ddpx", *train_args(tmp_path, "hang", "probe.action=hang", "probe.at_step=3",
                                                     "probe.rank=1", "trainer.timeout_s=600")]
    # the deadline comes 2 s after rank 1 hangs (its marker), rank 0 waiting in a collective
    log = tmp_path / "launcher.log"
    proc = harness.start(cmd, log, harness.base_env(probe_env()), cwd=tmp_path)
    harness.wait_for(lambda: proc.poll() is not None or (tmp_path / "marker").exists(), 60, poll=0.1)
    (launcher,) = harness.finish([proc], [log], timeout=2)
    assert (tmp_path / "marker").exists() and launcher.hung, launcher.output[-3000:]
    workers = worker_pids(tmp_path, "hang")
    assert len(workers) == 2 and not any(map(alive, workers)), workers
    assert re.search(r'elastic_probe.py", line \d+ in ddpx_batch_end', launcher.output), launcher.output[-3000:]


def worker_pids(tmp_path, label) -> list[int]:
    """The pids of the workers that started under ``label`` (the probe's start records)."""
    files = (tmp_path / "records").glob(f"steps-{label}-*.jsonl")
    return [r["pid"] for f in files for r in map(json.loads, f.read_text().splitlines()) if r["event"] == "start"]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie left for init to reap has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_one_rank_raising_stops_every_rank_quickly_and_names_it(ranks, tmp_path):
    code, log = train(ranks, tmp_path, "raise", "probe.action=raise", "probe.at_step=5", "probe.rank=1",
                      "trainer.timeout_s=300", timeout=120)
    assert code != 0
    # from the failure (the probe's marker), on the tests' clock: far less than trainer.timeout_s
    elapsed = harness.since((tmp_path / "marker").stat().st_mtime)
    assert elapsed < 30, f"took {elapsed:.0f} s to stop"
    # One line from the rank that raised, naming the plugin; no traceback, nothing from the launcher.
    assert re.search(r"^ddpx: error: \[rank1\] plugin 'elastic_probe' raised in ddpx_batch_end: RuntimeError: probe: "
                     r"injected failure on rank 1 at step \d+ \(elastic_probe.py:\d+\)$", log, re.MULTILINE), log[-3000:]
    assert "Traceback" not in log and "training failed" not in log, log[-3000:]



def test_a_hanging_rank_is_cut_short_by_the_steady_state_timeout(ranks, tmp_path):
    # Rank 1 stays alive but stops at step 5: rank 0's next collective times out
    # (trainer.timeout_s); torchrun SIGTERMs rank 1, which makes no progress and
    # gives up after checkpoint.stop_timeout_s instead of torchrun's 30 s.
    code, log = train(ranks, tmp_path, "hang", "probe.action=hang", "probe.at_step=5", "probe.rank=1",
                      "trainer.timeout_s=5", "checkpoint.stop_timeout_s=3", timeout=120)
    assert code != 0
    # from the hang (the probe's marker): timeout_s + stop_timeout_s and the stop's own work, less
    # than timeout_s + torchrun's 30 s
    elapsed = harness.since((tmp_path / "marker").stat().st_mtime)
    assert elapsed < 5 + 3 + 20, f"took {elapsed:.0f} s to stop"
    assert "Timed out waiting 5000ms" in log or "Application timeout" in log, log[-3000:]  # gloo's words
    assert "[rank1] ddpx: no optimizer step boundary for" in log, log[-3000:]


@pytest.mark.netns
@pytest.mark.timeout(280)
@pytest.mark.skipif(not harness.netns_available(), reason="needs root and ip netns")
def test_host_dying_ends_the_job_and_a_rerun_resumes_exactly(ranks, tmp_path, two_hosts):
    """Two one-worker "hosts" (static rendezvous, --max-restarts 0): host 1's agent
    and worker are SIGKILLed mid epoch 1. Configured not to restart, host 0 must
    end promptly with an error naming its rank and the lost peer; the checkpoints
    survive, and a rerun on one machine finishes every epoch exactly once."""
    records = tmp_path / "records"
    records.mkdir()
    (_, _, addr0), _ = two_hosts
    port = 29500 + os.getpid() % 1000
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    cmds = []
    for node, (ns, _, _) in enumerate(two_hosts):  # no GLOO_SOCKET_IFNAME: ddpx chooses it
        cmds.append([
            "ip", "netns", "exec", ns, sys.executable, "-m", "ddpx", "train", "--nnodes=2",
            "--nproc-per-node=1", f"--node-rank={node}", "--max-restarts=0", "--rdzv-backend=static",
            f"--rdzv-endpoint={addr0}:{port}", f"run_dir={tmp_path / 'run'}", "trainer.epochs=2",
            "optimizer.args.lr=0.1", "checkpoint.every_steps=4", "logging.progress=false",
            "plugins.enable=[elastic_probe]", f"probe.record_dir={records}", "probe.label=hosts",
            f"probe.marker={tmp_path / 'marker'}", "probe.action=kill_node", "probe.rank=1",
            f"probe.at_step={STEPS_PER_EPOCH + 7}",
        ])
    host0, host1 = ranks.commands(cmds, tmp_path, timeout=150, env=env, cwd=tmp_path, names=["host0", "host1"])
    out0 = host0.output
    assert (tmp_path / "marker").exists(), out0[-3000:]
    assert host1.returncode == -signal.SIGKILL or host1.returncode != 0
    assert host0.returncode == 1, out0[-3000:]  # a crashed peer: exit 1, not a hang
    # One line from host 0's rank, blaming the lost host, not the plugin whose collective broke
    # (and nothing more from its launcher).
    assert "[rank0] stopped at step " in out0 and "another rank failed, hung or lost its host" in out0, out0[-3000:]
    assert "training failed" not in out0, out0[-3000:]
    assert "Traceback" not in out0, out0[-3000:]

    (tmp_path / "marker").unlink()  # the rerun runs normally
    code, log = train(ranks, tmp_path, "rerun")
    assert code == 0, log[-3000:]
    seen, runs = committed_samples(tmp_path, ["hosts", "rerun"])
    assert runs[1][0] in (24, 28), runs[1][0]  # resumed from a checkpoint the 2-host run wrote
    assert_each_sample_once(seen)


@pytest.mark.netns
@pytest.mark.timeout(300)
@pytest.mark.skipif(not harness.netns_available(), reason="needs root and ip netns")
def test_elastic_membership_across_hosts_survivor_goes_on_and_the_host_rejoins(tmp_path, two_hosts):
    """`--nnodes 1:2 --max-restarts 3` on two hosts (c10d, hostname resolving to loopback,
    no IFNAME variables): host 1 is SIGKILLed mid epoch 1; host 0 goes on at world size 1
    from the last checkpoint; host 1 started again is admitted and the run ends at world
    size 2, every sample seen once per epoch."""
    host_death = harness.benchmark("bench_host_death")
    groups, run_scenario = host_death.groups, host_death.run_scenario

    run = run_scenario(tmp_path, two_hosts, rejoin_after=2.0, timeout=240)
    logs = "\n".join(f"--- {name}\n{log[-2500:]}" for name, log in run["logs"].items())
    assert run["exit_codes"] == {"host0": 0, "host1": -signal.SIGKILL, "host1-again": 0}, logs
    assert run["world_sizes"] == [2, 1, 2], logs
    found = groups(tmp_path / "records")
    # host 0 resumed alone from a checkpoint written before the kill (28, or 24 with 28 in flight)
    assert found[1]["start_step"] in (24, 28), run["start_steps"]
    seen = {}
    for i, group in enumerate(found):
        resumed_at = found[i + 1]["start_step"] if i + 1 < len(found) else None
        for record in group["steps"]:
            if resumed_at is None or record["step"] <= resumed_at:
                seen.setdefault(record["epoch"], Counter()).update(record["indices"])
    assert_each_sample_once(seen, epochs=range(6))
    assert final_accuracy(tmp_path / "run") > 0.8
    assert "frame #" not in logs  # no C++ stack trace reaches the user

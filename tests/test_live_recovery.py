"""Live recovery end to end (``elastic.recovery: live``): a Lighthouse and 2-3 replica groups of
one rank each, ``ddpx train`` through torchrun on loopback, gloo, hard timeouts.

The fault plugin (tests/live_faults.py) kills a group (its agent and worker, as a host dying) at a
named point of a step and records every committed step. What must hold whatever the fault:

* the survivors never exit until training ends, and each says "N -> M replica groups" once per
  membership change;
* the committed steps of an epoch tile it: their sampler positions run from 0 to the epoch's end
  without a gap or an overlap, and the samples the groups trained in a step are exactly those of
  the step's global batches (nothing repeated, nothing skipped);
* a group that comes back heals (one line) and ends with the survivors' weights.
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import harness

pytest.importorskip("torchft", reason="elastic.recovery=live needs torchft (pip install 'ddpx[ft]')")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TESTS = Path(__file__).resolve().parent
NUM_TRAIN = 1438  # digits_split(test_fraction=0.2): training samples


def start_lighthouse(tmp_path, port, name="lighthouse"):
    return harness.start([sys.executable, "-m", "ddpx", "lighthouse", f"--port={port}", "--heartbeat-timeout-s=1"],
                         tmp_path / f"{name}.log", harness.base_env())


def start_group(tmp_path, port, label, *extra, epochs=3, sleep=0.02, alone=0.3, log=None):
    records = tmp_path / "records"
    records.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "ddpx", "train", "--nproc-per-node=1", f"run_dir={tmp_path / (log or label)}",
           f"--lighthouse=127.0.0.1:{port}", f"trainer.epochs={epochs}", "logging.progress=false",
           "plugins.enable=[live_faults]", f"faults.record_dir={records}", f"faults.label={label}",
           f"faults.step_sleep_s={sleep}", f"faults.alone_sleep_s={alone}", *extra]
    env = harness.base_env({"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])})
    return harness.start(cmd, tmp_path / f"{log or label}.log", env)


def stop(lighthouse):
    lighthouse.terminate()
    assert harness.wait_for(lambda: lighthouse.poll() is not None, 30), "the Lighthouse ignored SIGTERM"


def records(tmp_path, label, marked=False):
    """Every committed step this group's processes recorded, in order (``marked``: each with
    ``superseded``, true where a later heal of the same process reached its step)."""
    found = []
    for path in sorted((tmp_path / "records").glob(f"{label}-*.jsonl"), key=lambda p: p.stat().st_mtime):
        mine = []
        for r in (json.loads(line) for line in path.read_text().splitlines()):
            if r.get("event") == "ready":  # the process started training: no step
                continue
            if r.get("event") == "healed":
                for earlier in mine:
                    earlier["superseded"] |= (earlier["epoch"], earlier["step"]) <= (r["epoch"], r["step"])
                continue
            mine.append(dict(r, superseded=False))
        found += mine
    return found if marked else [r for r in found if not r["superseded"]]


def check_epochs_tiled(tmp_path, labels, epochs):
    """The committed steps (as any group recorded them) tile every epoch, and in each step the
    groups trained disjoint samples of the step's global batches: all of them where every group
    of the step recorded it (a group that failed to commit a step the others committed heals
    and records nothing for it). Records of a branch that a heal replaced are left out."""
    from ddpx.data.sampler import ResumableDistributedBatchSampler

    steps, trained = {}, {}
    every = [r for label in labels for r in records(tmp_path, label, marked=True)]
    kept = [r for r in every if not r["superseded"]]
    kept_keys = {(r["epoch"], r["step"]): r for r in kept}
    for r in every:  # a superseded record counts where it agrees with the branch that went on
        key = (r["epoch"], r["step"])
        if r["superseded"] and key in kept_keys and (kept_keys[key]["before"], kept_keys[key]["after"]) != \
                (r["before"], r["after"]):
            continue
        assert steps.setdefault(key, r)["before"] == r["before"] and steps[key]["after"] == r["after"], \
            f"two groups committed step {key} over other samples"
        trained.setdefault(key, []).append(r["indices"])
    for epoch in range(epochs):
        mine = sorted((r for (e, _), r in steps.items() if e == epoch), key=lambda r: r["step"])
        assert mine, f"no step was committed in epoch {epoch}"
        assert mine[0]["before"] == 0 and mine[-1]["after"] == NUM_TRAIN, (mine[0], mine[-1])
        order = ResumableDistributedBatchSampler(NUM_TRAIN, 32, 0, 1, seed=0)
        order.set_epoch(epoch)
        order = order.epoch_order().tolist()
        for prev, r in zip(mine, mine[1:]):
            assert r["before"] == prev["after"], f"epoch {epoch}: a gap or overlap between steps {prev['step']} and {r['step']}"
        for r in mine:
            parts = trained[(epoch, r["step"])]
            samples = sorted(i for part in parts for i in part)
            assert len(set(samples)) == len(samples), f"epoch {epoch} step {r['step']}: a sample trained twice"
            batch = order[r["before"]:r["after"]]
            assert set(samples) <= set(batch), f"epoch {epoch} step {r['step']}: samples outside its global batches"
            if len(parts) == r["groups"]:
                assert samples == sorted(batch), f"epoch {epoch} step {r['step']}: samples of its batches untrained"


def final_weights(tmp_path, label):
    from safetensors.torch import load_file

    return load_file(str(tmp_path / label / "model" / "model.safetensors"))


def lines(log, text):
    return [line for line in log.splitlines() if text in line]


def wait_for_exit(proc, seconds=120):
    assert harness.wait_for(lambda: proc.poll() is not None, seconds), "the group the fault kills did not die"


def test_groups_killed_inside_the_exchange_and_in_a_checkpoint_are_dropped_and_one_heals_back(tmp_path):
    """Three groups: B dies with its exchange's collective in flight (int8), C while writing a
    checkpoint; A trains on, B comes back (B2) and heals from A."""
    port = harness.free_port()
    lighthouse = start_lighthouse(tmp_path, port)
    common = ("comm_hook.name=int8", "checkpoint.every_steps=4")
    wait = f"faults.alone_wait_for={tmp_path / 'records'}/B-*.jsonl"  # A alone waits for B2
    try:
        a = start_group(tmp_path, port, "A", *common, wait)
        b = start_group(tmp_path, port, "B", *common, "faults.point=in_collective", "faults.at_step=8")
        c = start_group(tmp_path, port, "C", *common, "faults.point=checkpoint", "faults.at_step=12")
        wait_for_exit(b)
        for path in (tmp_path / "records").glob("B-*.jsonl"):
            path.rename(path.with_name("first" + path.name))  # B2's records are the ones A waits for
        b2 = start_group(tmp_path, port, "B", *common, log="B2")
        ended = harness.finish([a, b2, c], [tmp_path / f"{x}.log" for x in ("A", "B2", "C")], timeout=180)
    finally:
        stop(lighthouse)
    a_end, b2_end, c_end = ended
    assert a_end.returncode == 0, a_end.output[-3000:]
    assert b2_end.returncode == 0, b2_end.output[-3000:]
    assert c_end.returncode != 0
    first_b = [json.loads(line) for p in (tmp_path / "records").glob("firstB-*.jsonl")
               for line in p.read_text().splitlines()]
    assert max(r["step"] for r in first_b if "indices" in r) < 8  # died in step 8's exchange
    assert max(r["step"] for r in records(tmp_path, "C")) == 12  # died writing the checkpoint after step 12
    assert len(lines(a_end.output, "replica groups at step")) >= 3, a_end.output[-3000:]  # B, C gone; B2 back
    assert "-> 2 replica groups" in lines(a_end.output, "replica groups at step")[-1]  # B2 joined
    assert len(lines(b2_end.output, "healed from a peer")) == 1
    check_epochs_tiled(tmp_path, ["A", "firstB", "B", "C"], epochs=3)
    a_w, b_w = final_weights(tmp_path, "A"), final_weights(tmp_path, "B2")
    assert all(torch.equal(a_w[k], b_w[k]) for k in a_w)
    accuracy = float(lines(a_end.output, "finished after")[0].split("accuracy ")[1].split(";")[0])
    assert accuracy > 0.9


def test_a_group_that_dies_while_healing_comes_back_and_heals_into_the_next_epoch(tmp_path):
    port = harness.free_port()
    lighthouse = start_lighthouse(tmp_path, port)
    big = "trainer.batch_size=64"  # 23 steps an epoch alone: A is in epoch 1 soon
    try:
        a = start_group(tmp_path, port, "A", big, epochs=6)
        c = start_group(tmp_path, port, "C", big, "faults.point=after_exchange", "faults.at_step=0", epochs=6)
        assert harness.wait_for(lambda: records(tmp_path, "A") and records(tmp_path, "A")[-1]["epoch"] >= 1, 120)
        wait_for_exit(c)  # died after an exchange, before the groups decided on its commit
        b = start_group(tmp_path, port, "B", big, "faults.point=heal_receive", "faults.at_step=1", epochs=6)
        wait_for_exit(b)
        b2 = start_group(tmp_path, port, "B", big, log="B2", epochs=6)
        ended = harness.finish([a, b2], [tmp_path / "A.log", tmp_path / "B2.log"], timeout=180)
    finally:
        stop(lighthouse)
    a_end, b2_end = ended
    assert a_end.returncode == 0, a_end.output[-3000:]
    assert b2_end.returncode == 0, b2_end.output[-3000:]
    assert len(records(tmp_path, "C")) == 1  # one committed step, then killed after the next one's exchange
    assert all(r["epoch"] >= 1 for r in records(tmp_path, "B"))  # B died healing, B2 healed: no step from 0
    healed = lines(b2_end.output, "healed from a peer")
    assert len(healed) == 1 and "(epoch 0)" not in healed[0], healed  # into another epoch than its own
    check_epochs_tiled(tmp_path, ["A", "B", "C"], epochs=6)
    a_w, b_w = final_weights(tmp_path, "A"), final_weights(tmp_path, "B2")
    assert all(torch.equal(a_w[k], b_w[k]) for k in a_w)


def test_a_lighthouse_killed_and_restarted_stalls_the_groups_which_then_go_on_together(tmp_path):
    port = harness.free_port()
    lighthouse = start_lighthouse(tmp_path, port)
    try:
        # the two quorums that form after the restart meet at a collective one of them waits in:
        # elastic.timeout_s bounds that wait
        procs = [start_group(tmp_path, port, x, "elastic.timeout_s=5", epochs=4, sleep=0.05) for x in "AB"]
        c = start_group(tmp_path, port, "C", "elastic.timeout_s=5", "faults.point=before_exchange",
                        "faults.at_step=0", epochs=4, sleep=0.05)
        wait_for_exit(c)  # died before an exchange, after one committed step
        assert harness.wait_for(lambda: records(tmp_path, "A") and records(tmp_path, "A")[-1]["groups"] == 2, 120)
        lighthouse.kill()
        lighthouse.wait()
        killed = len(records(tmp_path, "A"))
        harness.wait_for(lambda: False, 3)  # the Lighthouse is away for 3 s
        lighthouse = start_lighthouse(tmp_path, port, name="lighthouse2")
        ended = harness.finish(procs, [tmp_path / "A.log", tmp_path / "B.log"], timeout=180)
    finally:
        stop(lighthouse)
    for end in ended:
        assert end.returncode == 0, end.output[-3000:]
    assert len(records(tmp_path, "A")) > killed + 10  # it trained on after the outage
    assert len(records(tmp_path, "C")) == 1
    check_epochs_tiled(tmp_path, ["A", "B", "C"], epochs=4)
    a_w, b_w = final_weights(tmp_path, "A"), final_weights(tmp_path, "B")
    assert all(torch.equal(a_w[k], b_w[k]) for k in a_w)

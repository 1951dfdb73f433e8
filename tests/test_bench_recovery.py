"""benchmarks/bench_recovery.py's pure helpers: records and log lines into per-failure numbers, on a
small fabricated run (no process starts: the scenarios themselves need root and network namespaces)."""

import json

import pytest

import harness

bench = harness.benchmark("bench_recovery")


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"cut short')  # a SIGKILL mid-line


def steps(first_step, times, groups):
    return [{"epoch": 0, "step": first_step + i, "before": 0, "after": 0, "groups": g, "indices": [], "time": t}
            for i, (t, g) in enumerate(zip(times, groups))]


MEMBERSHIP_LOG = """\
[rank0] replica group 10.0.0.1:4000: training with 3 replica group(s) (Lighthouse 10.0.0.1:29510) from step 0
[rank0] replica group 10.0.0.1:4000: 3 -> 2 replica groups at step 5 (1.1 s since the last committed step; 1 step(s) dropped)
[rank0] replica group 10.0.0.1:4000: 2 -> 3 replica groups at step 9 (0.2 s since the last committed step; 0 step(s) dropped)
[rank0] epoch 0 (step 12): loss 0.5  eval_loss 0.4  accuracy 0.9
[rank0] finished after 9.0 s of training (step 12); epoch 0: loss 0.5  eval_loss 0.4  accuracy 0.91; run directory /r
"""


def test_log_lines_parse_into_membership_changes_and_final_metrics():
    changes = bench.membership_changes(MEMBERSHIP_LOG)
    assert changes == [{"before": 3, "after": 2, "step": 5, "since_commit_s": 1.1, "dropped": 1},
                       {"before": 2, "after": 3, "step": 9, "since_commit_s": 0.2, "dropped": 0}]
    assert bench.final_metrics(MEMBERSHIP_LOG) == {"epoch": 0, "loss": 0.5, "eval_loss": 0.4, "accuracy": 0.91}
    assert bench.final_metrics("no summary") is None


def test_gaps_and_step_time():
    times = [0.0, 0.2, 0.4, 1.6, 1.8, 2.0]
    assert bench.step_time(times) == pytest.approx(0.2)
    assert bench.gap_around(times, 0.5) == pytest.approx(1.2)  # the gap the kill falls in
    assert bench.gap_around(times, 0.1, 1.7) == pytest.approx(1.2)  # the largest from 0.0 to 1.8
    assert bench.gap_around(times, -1.0) is None and bench.gap_around(times, 3.0) is None
    assert bench.ordinary_step(times, 1.0) == pytest.approx(0.2)


def test_live_records_become_per_failure_numbers(tmp_path):
    # host 0 (a survivor): 3 groups every 0.2 s, killed at 1.0, alone-with-host-1 from 2.2 (a 1.4 s
    # stall), host 2 restarted at 3.0, ready at 10.0, its first committed step at 12.0 (a survivors' gap
    # of 1.6 s from 10.4 to 12.0)
    before = [0.2 * i for i in range(1, 6)]
    during = [2.2 + 0.2 * i for i in range(42)]  # up to 10.4
    survivor = steps(1, before + during + [12.0, 12.2], [3] * 5 + [2] * 42 + [3, 3])
    write(tmp_path / "host0-11.jsonl", [{"event": "ready", "epoch": 0, "step": 0, "time": 0.0}] + survivor)
    write(tmp_path / "host2-12.jsonl", [{"event": "ready", "epoch": 0, "step": 0, "time": 0.05}] +
          steps(1, before, [3] * 5))
    write(tmp_path / "host2-13.jsonl", [{"event": "ready", "epoch": 0, "step": 0, "time": 10.0},
                                        {"event": "healed", "epoch": 0, "step": 47}] + steps(48, [12.0, 12.2], [3, 3]))
    victim = bench.live_incarnations(tmp_path, "host2")
    assert [inc["ready"] for inc in victim] == [0.05, 10.0]
    assert [r["step"] for r in victim[1]["steps"]] == [48, 49]  # the healed marker is no step
    survivors = {"host0": [r for inc in bench.live_incarnations(tmp_path, "host0") for r in inc["steps"]]}
    (row,) = bench.live_failures([{"killed": 1.05, "restarted": 3.0}], survivors, victim,
                                 {"host0": bench.membership_changes(MEMBERSHIP_LOG)})
    assert row["failure"] == 1
    assert row["ready_to_first_step_s"] == pytest.approx(2.0)
    assert row["stall_death_s"] == pytest.approx(1.2)  # 1.0 -> 2.2
    assert row["since_commit_s"] == 1.1 and row["dropped_steps"] == 1
    assert row["stall_rejoin_s"] == pytest.approx(1.6)  # 10.4 -> 12.0
    assert row["step_s"] == pytest.approx(0.2)
    assert row["lost_s"] == pytest.approx((1.2 - 0.2) + (1.6 - 0.2) + 1 * 0.2)


def test_restart_records_become_per_failure_numbers(tmp_path):
    # host 0 under elastic restart: world size 3 steps 1-8 every 0.5 s (checkpoint at 5), killed at 4.2;
    # the new group of 2 resumes from step 5 at 10.0 (steps 6.. again from 10.5); host 2 restarted at
    # 12.0, the group of 3 resumes from step 10 at 20.0 (last step before: 12 at 13.5)
    first = [{"event": "start", "world_size": 3, "step": 0, "epoch": 0, "pid": 1, "time": 0.0}] + \
        [{"event": "step", "epoch": 0, "step": s, "indices": [], "time": 0.5 * s} for s in range(1, 9)]
    alone = [{"event": "start", "world_size": 2, "step": 5, "epoch": 0, "pid": 2, "time": 10.0}] + \
        [{"event": "step", "epoch": 0, "step": s, "indices": [], "time": 10.5 + 0.5 * (s - 6)} for s in range(6, 13)]
    again = [{"event": "start", "world_size": 3, "step": 10, "epoch": 0, "pid": 3, "time": 20.0},
             {"event": "step", "epoch": 0, "step": 11, "indices": [], "time": 20.5}]
    write(tmp_path / "steps-host0-0-rank0.jsonl", first)
    write(tmp_path / "steps-host0-1-rank2.jsonl", alone + again)  # an agent restarted for a new member (rank 2 now)
    write(tmp_path / "steps-host0-1-rank3.jsonl", alone[:2])  # its second rank: the same group
    survivor = bench.restart_groups(tmp_path, "host0")
    assert [(g["world_size"], g["start_step"]) for g in survivor] == [(3, 0), (2, 5), (3, 10)]
    (row,) = bench.restart_failures([{"killed": 4.2, "restarted": 12.0}], survivor)
    assert row["death_to_training_s"] == pytest.approx(10.5 - 4.2)
    assert row["death_stall_s"] == pytest.approx(10.5 - 4.0)  # from step 8 at 4.0
    assert row["redone_steps"] == 8 - 5
    assert row["rejoin_stall_s"] == pytest.approx(20.5 - 13.5)
    assert row["rejoin_redone_steps"] == 12 - 10
    assert row["step_s"] == pytest.approx(0.5)
    assert row["lost_s"] == pytest.approx((6.5 - 0.5) + (7.0 - 0.5) + (3 + 2) * 0.5)


def test_summary_takes_median_and_range_of_what_was_measured():
    rows = [{"lost_s": 1.0}, {"lost_s": 3.0}, {"lost_s": 2.0}, {"lost_s": None}]
    assert bench.summary(rows, ["lost_s", "absent"]) == {"lost_s": {"median": 2.0, "min": 1.0, "max": 3.0}}

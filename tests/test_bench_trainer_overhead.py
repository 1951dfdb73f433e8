"""benchmarks/bench_trainer_overhead.py runs and reports what it promises (tiny settings:
one launch, two rounds; the figures themselves are noise at this size)."""

import json
import os
import sys

import pytest

import harness

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                     "bench_trainer_overhead.py")

pytestmark = pytest.mark.timeout(240)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["--skip-launch", "--noise-floor"])
def test_interleaved_comparison_reports_its_ratios(mode, tmp_path):
    code, out, err = harness.run([sys.executable, BENCH, mode, "--interleaved-launches", "1", "--rounds", "2",
                                  "--json"], timeout=200, cwd=tmp_path)
    assert code == 0, err[-3000:]
    result = json.loads(out)
    assert result["noise_floor"] == (mode == "--noise-floor")
    assert "launch" not in result  # both modes skip the separate launches
    r = result["interleaved"]
    assert r["launches"] == 1 and r["rounds"] == 2
    assert r["launch_ratios"] == [r["ratio_median"]]
    assert r["ratio_median"] == pytest.approx(r["ddpx_step_ms_median"] / r["hand_step_ms_median"])
    assert r["cpu_ratio"] == pytest.approx(r["ddpx_cpu_us"] / r["hand_cpu_us"])
    assert 0.1 < r["hand_step_ms"] < 1000 and 0.1 < r["ddpx_step_ms"] < 1000  # ms per step of a small MLP
    for prefix in ("", "cpu_"):
        low, high = r[f"{prefix}paired_ratio_interval"]
        assert 0 < low <= r[f"{prefix}paired_ratio"] <= high
    if mode == "--noise-floor":
        assert "own_work_us" not in r  # no ddpx loop ran
    else:
        assert 0 < r["own_work_us"] < 0.5 * r["hand_cpu_us"]


@pytest.mark.slow
def test_a_bad_override_is_one_line_before_anything_launches(tmp_path):
    code, _, err = harness.run([sys.executable, BENCH, "--skip-launch", "trainer.epoch=3"], timeout=60,
                               cwd=tmp_path)
    assert code == 1
    assert err.strip() == ("bench_trainer_overhead: unknown key 'trainer.epoch' in section 'trainer'; "
                                   "did you mean 'trainer.epochs'?")
    assert not any(tmp_path.iterdir())  # no run started


def test_paired_ratio_interval_widens_with_launch_to_launch_differences():
    bench = import_bench()
    assert bench.paired_ratios([2.0, 3.3], [2.0, 3.0]) == pytest.approx([1.0, 1.1])
    assert bench.median_with_interval([[1.02] * 50, [1.02] * 50]) == pytest.approx((1.02, 1.02, 1.02))
    # Two launches whose pairs agree within each launch but not with each other: the
    # pooled median lies between them and the interval reaches towards both.
    spread = [0.001 * (i % 5) for i in range(60)]
    apart = [[1.00 + x for x in spread], [1.06 + x for x in spread]]
    ratio, low, high = bench.median_with_interval(apart)
    assert 1.004 < ratio < 1.06 and low <= 1.004 and high >= 1.06
    ratio, low, high = bench.median_with_interval([[1.00 + x for x in spread]])  # one launch: its pairs only
    assert (ratio, low, high) == pytest.approx((1.002, 1.002, 1.002), abs=0.0011)
    assert bench.verdict(1.01, 1.025, 1.03).startswith("within")
    assert bench.verdict(1.031, 1.05, 1.03).startswith("over")
    assert bench.verdict(1.02, 1.04, 1.03).startswith("not resolved")


# --- --instructions: the counting worker and the arithmetic (valgrind itself takes minutes) ---------------


def import_bench():
    sys.path.insert(0, os.path.dirname(BENCH))
    try:
        import bench_trainer_overhead
    finally:
        sys.path.pop(0)
    return bench_trainer_overhead


@pytest.mark.slow
@pytest.mark.parametrize("loop,epochs", [("hand", 1), ("ddpx", 2)])
def test_count_worker_runs_the_asked_epochs_of_one_loop(loop, epochs, tmp_path):
    bench = import_bench()
    env = bench.worker_env(**bench.one_rank_env())
    out = tmp_path / "count.json"
    code, _, err = harness.run([sys.executable, BENCH, "--count-worker", loop, "--epochs", str(epochs), "--out",
                                str(out), "logging.progress=false"], timeout=200, cwd=tmp_path, env=env)
    assert code == 0, err[-3000:]
    assert json.loads(out.read_text()) == {"steps": 45 * epochs}  # 1437 digits, batches of 32, one rank


def test_instructions_per_step_is_the_difference_of_two_runs(monkeypatch):
    bench = import_bench()
    per_step, set_up = {"ddpx": 3_300_000, "hand": 3_200_000}, {"ddpx": 7e9, "hand": 6e9}
    monkeypatch.setattr(bench, "count_instructions",
                        lambda loop, epochs, workdir, overrides: (set_up[loop] + per_step[loop] * 45 * epochs, 45 * epochs))
    result = bench.instructions_per_step(3, "/nonexistent", [])
    assert result["ddpx_instructions_per_step"] == 3_300_000 and result["hand_instructions_per_step"] == 3_200_000
    assert result["ratio"] == pytest.approx(33 / 32)
    stderr = "==1== Command: python x.py\n==1== \n==1== I   refs:      5,291,915,649\n"
    assert bench.valgrind_instructions(stderr) == 5_291_915_649
    with pytest.raises(SystemExit, match="no 'I refs' line"):
        bench.valgrind_instructions("==1== killed\n")

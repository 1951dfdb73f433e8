"""benchmarks/bench_trainer_overhead.py runs and reports what it promises (tiny settings:
one launch, two rounds; the figures themselves are noise at this size)."""

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                     "bench_trainer_overhead.py")

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("mode", ["--skip-launch", "--noise-floor"])
def test_interleaved_comparison_reports_its_ratios(mode, tmp_path):
    proc = subprocess.run([sys.executable, BENCH, mode, "--interleaved-launches", "1", "--rounds", "2", "--json"],
                          capture_output=True, text=True, timeout=200, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["noise_floor"] == (mode == "--noise-floor")
    assert "launch" not in result  # both modes skip the separate launches
    r = result["interleaved"]
    assert r["launches"] == 1 and r["rounds"] == 2
    assert r["launch_ratios"] == [r["ratio_median"]]
    assert r["ratio_median"] == pytest.approx(r["ddpx_step_ms_median"] / r["hand_step_ms_median"])
    assert r["cpu_ratio"] == pytest.approx(r["ddpx_cpu_us"] / r["hand_cpu_us"])
    assert 0.1 < r["hand_step_ms"] < 1000 and 0.1 < r["ddpx_step_ms"] < 1000  # ms per step of a small MLP
    if mode == "--noise-floor":
        assert "own_work_us" not in r  # no ddpx loop ran
    else:
        assert 0 < r["own_work_us"] < 0.5 * r["hand_cpu_us"]

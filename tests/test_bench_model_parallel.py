"""benchmarks/bench_model_parallel.py's arithmetic (the ideal bubble, per-stage figures from the
stage_timing plugin's record, the non-block floor) and its cells' configs; the runs themselves
take minutes (docs/model_parallel.md, "Measured")."""

import argparse

import pytest

import harness

bench = harness.benchmark("bench_model_parallel")


def test_the_ideal_bubble_per_schedule():
    assert bench.ideal_bubble("1f1b", 2, 4) == pytest.approx(1 / 5)
    assert bench.ideal_bubble("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert bench.ideal_bubble("1f1b", 4, 2) == pytest.approx(3 / 5)  # runs as GPipe: the same bubble
    assert bench.ideal_bubble("interleaved_1f1b", 2, 4) == pytest.approx(1 / 9)  # 2 stages per rank


def _step(t, schedule, wait, compute, fb, cpu=None):
    return {"step_end_s": t, "schedule_s": schedule, "wait_s": wait, "compute_s": compute, "forward_backward_s": fb,
            "compute_cpu_s": compute if cpu is None else cpu, "forward_backward_cpu_s": compute if cpu is None else cpu}


def test_stage_figures_are_per_step_after_the_warmup():
    # cumulative totals after each of 4 steps; the first is warm-up (the shapes are learnt), then
    # steps of 1.0 s: forward_backward 0.8, the schedule 0.7 of it, compute 0.5 (0.25 on a core), waits 0.15
    steps = [_step(10.0, 5.0, 3.0, 1.0, 5.5, 0.5)]
    for i in range(1, 4):
        last = steps[-1]
        steps.append(_step(last["step_end_s"] + 1.0, last["schedule_s"] + 0.7, last["wait_s"] + 0.15,
                           last["compute_s"] + 0.5, last["forward_backward_s"] + 0.8, last["compute_cpu_s"] + 0.25))
    out = bench.stage_figures({"strategy": "pipeline", "stages": [1], "steps": steps}, warmup=1)
    assert out["ms_per_step"] == pytest.approx(1000.0)
    assert out["forward_backward_ms"] == pytest.approx(800.0)
    assert out["idle"] == pytest.approx(0.3 / 0.8)  # everything in forward_backward but the compute
    assert out["p2p"] == pytest.approx(0.15 / 0.8)
    assert out["sync"] == pytest.approx(0.1 / 0.8)  # after the schedule
    assert out["other"] == pytest.approx(0.05 / 0.8)
    assert out["idle"] == pytest.approx(out["p2p"] + out["sync"] + out["other"])
    assert out["preempted"] == pytest.approx(0.25 / 0.8)
    assert out["on_cpu"] == pytest.approx(0.25 / 0.8)
    assert out["stages"] == [1]


def test_the_non_block_floor_of_the_char_gpt():
    split = bench.model_split(4, 128)
    # token embedding 128 x 128 (the head is tied to it), position 64 x 128, the final norm 2 x 128
    assert split["other_parameters"] == 128 * 128 + 64 * 128 + 2 * 128
    assert split["parameters"] == split["block_parameters"] + split["other_parameters"]


@pytest.mark.parametrize("schedule", bench.SCHEDULES)
def test_every_timing_cell_is_a_valid_config(schedule):
    from ddpx.config import load_config

    args = argparse.Namespace(ranks=2, layers=8, width=128, batch=32, warmup=2, steps=6, schedules=[schedule],
                              microbatches=[2, 4, 8])
    for name, cell in bench.timing_cells(args).items():
        overrides = bench.common_overrides(args.layers, args.width, 8, args.batch)
        if cell["strategy"] == "pipeline":
            overrides += bench.pipeline_overrides(args.ranks, cell["schedule"], cell["microbatches"])
        config = load_config(str(bench.CONFIG), overrides)
        assert config.trainer.strategy == cell["strategy"], name
        if cell["strategy"] == "pipeline":
            assert config.pipeline.stages_per_rank == (2 if schedule == "interleaved_1f1b" else 1)

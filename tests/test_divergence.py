"""Diverging runs: the non-finite guard, best checkpoints by metric, early stopping."""

import json
import math
import os

import pytest
import torch
from sample_plugins import NAN_FROM_ENV, SCORES_ENV

from ddpx.rank.checkpoint_files import CheckpointDirectory
from ddpx.errors import TrainingDiverged
from ddpx.train.trainer import Trainer

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def checkpoints(tmp_path):
    return CheckpointDirectory(tmp_path / "run" / "checkpoints")


def assert_finite_checkpoint(path):
    state = torch.load(path, map_location="cpu", weights_only=False)
    for entry in ("model", "optimizer"):
        tensors = state["replicated"][entry]
        flat = tensors.values() if entry == "model" else [t for p in tensors["state"].values() for t in p.values()]
        assert all(bool(t.isfinite().all()) for t in flat if torch.is_tensor(t) and t.is_floating_point())
    return state


NAN = "plugins.enable=[sample_plugins.NanLossFromStep]"


def test_nan_loss_stops_one_rank_run_and_keeps_the_finite_checkpoints(make_config, tmp_path, monkeypatch):
    # 45 steps an epoch on one rank; saves every 10 steps, keep 2; NaN from step 57.
    monkeypatch.setenv(NAN_FROM_ENV, "57")
    config = make_config(NAN, "trainer.epochs=4", "checkpoint.every_steps=10", "checkpoint.keep=2",
                         "checkpoint.stop_check_every=5")
    trainer = Trainer(config)
    with pytest.raises(TrainingDiverged) as diverged:
        trainer.run()
    message = str(diverged.value)
    # Found at the first stop check after step 57 (every 5 steps): steps 56-60.
    assert "the loss went non-finite between optimizer steps 56 and 60 (epoch 1)" in message
    assert trainer.global_step == 60
    newest = checkpoints(tmp_path).checkpoints()[-1][1]
    assert f"newest checkpoint with finite weights: {newest}" in message
    assert [step for step, _ in checkpoints(tmp_path).checkpoints()] == [45, 50]  # 60 was never written
    assert_finite_checkpoint(newest)
    # A rerun (without the NaN) resumes from it and finishes.
    monkeypatch.setenv(NAN_FROM_ENV, "1000000")
    metrics = Trainer(make_config(NAN, "trainer.epochs=4")).run()
    assert metrics[0]["epoch"] == 1 and metrics[-1]["epoch"] == 3
    assert math.isfinite(metrics[-1]["loss"]) and metrics[-1]["accuracy"] > 0.9


def test_warn_goes_on_but_never_writes_nonfinite_weights(make_config, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv(NAN_FROM_ENV, "57")
    config = make_config(NAN, "trainer.epochs=3", "checkpoint.every_steps=10", "checkpoint.keep=2",
                         "trainer.nonfinite=warn", "checkpoint.stop_check_every=5")
    metrics = Trainer(config).run()
    assert len(metrics) == 3 and math.isnan(metrics[-1]["loss"])
    err = capfd.readouterr().err
    assert "the loss went non-finite between optimizer steps 56 and 60" in err
    assert "the weights are non-finite between optimizer steps 51 and 60 (epoch 1): no checkpoint written" in err
    assert err.count("the loss went non-finite between") == 2  # once an epoch (epochs 1 and 2)
    saved = checkpoints(tmp_path).checkpoints()
    assert [step for step, _ in saved] == [45, 50]  # the finite ones were not rotated away
    assert_finite_checkpoint(saved[-1][1])


def test_fp16_overflow_steps_are_skipped_not_divergence(make_config, tmp_path):
    # A huge initial scale overflows the first fp16 backward passes: the GradScaler
    # skips those steps and lowers the scale; the loss stays finite.
    trainer = Trainer(make_config("trainer.epochs=3", "amp.enabled=true", "amp.dtype=fp16",
                                  "amp.init_scale=1e8", "checkpoint.stop_check_every=1"))
    metrics = trainer.run()
    assert 5 <= metrics[0]["amp_skipped_steps"] < 45  # some of epoch 0's steps, not all
    assert metrics[-1]["loss"] < metrics[0]["loss"] and metrics[-1]["accuracy"] > 0.6


def test_fp16_loss_that_stays_nonfinite_is_divergence_once_the_scale_collapses(make_config, tmp_path, monkeypatch):
    monkeypatch.setenv(NAN_FROM_ENV, "5")
    trainer = Trainer(make_config(NAN, "trainer.epochs=3", "amp.enabled=true", "amp.dtype=fp16"))
    with pytest.raises(TrainingDiverged, match=r"the loss went non-finite by optimizer step 38 \(epoch 0\): every "
                                               r"fp16 step overflowed until the loss scale fell to 7.62939e-06"):
        trainer.run()  # 65536 halved 33 times from step 6 on
    assert checkpoints(tmp_path).checkpoints() == []  # no epoch end reached


def read_epoch_lines(tmp_path):
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "epoch"]


def test_best_checkpoints_by_metric_survive_rotation_and_a_restart(make_config, tmp_path, monkeypatch, capfd):
    scores = [0.1, 0.9, 0.3, 0.5, 0.95, 0.2, 0.1, 0.0]
    monkeypatch.setenv(SCORES_ENV, json.dumps(scores))
    common = ["plugins.enable=[sample_plugins.ScriptedScore]", "checkpoint.monitor=score", "checkpoint.keep=1",
              "checkpoint.keep_best=2", "trainer.eval_every_epochs=0"]
    Trainer(make_config("trainer.epochs=4", *common)).run()
    directory = checkpoints(tmp_path)
    best = directory.best()
    assert [(e["epoch"], e["value"]) for e in best] == [(1, 0.9), (3, 0.5)]
    Trainer(make_config("trainer.epochs=8", *common)).run()  # resumes at epoch 4
    best = directory.best()
    assert [(e["epoch"], e["value"]) for e in best] == [(4, 0.95), (1, 0.9)]
    steps = [step for step, _ in directory.checkpoints()]
    assert steps == [2 * 45, 5 * 45, 8 * 45]  # the two best and the newest; the rest rotated away
    link = directory.directory / "best.pt"
    assert os.readlink(link) == best[0]["file"]
    assert torch.load(link, weights_only=False)["replicated"]["progress"] == {"epoch": 5, "global_step": 5 * 45}
    capfd.readouterr()
    assert Trainer(make_config("trainer.epochs=8", *common)).run() == []  # finished: nothing to train
    assert (f"best checkpoint by score (max): {link} -> step-000000225.pt (score 0.95, epoch 4)"
            in capfd.readouterr().err)


def test_monitor_and_mode_errors_are_one_line(make_config, tmp_path):
    from ddpx.errors import DdpxError

    with pytest.raises(DdpxError, match=r"^checkpoint.mode must be one of auto, max, min, got 'up'$"):
        make_config("checkpoint.monitor=accuracy", "checkpoint.mode=up")
    with pytest.raises(DdpxError, match=r"^early_stopping.patience must be >= 1, got 0$"):
        make_config("early_stopping.monitor=accuracy", "early_stopping.patience=0")


def cli(ranks, tmp_path, *args, env=None, timeout=180):
    env = {"PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    return ranks.cli(["train", f"run_dir={tmp_path}/run", "logging.progress=false", "model.args.hidden=16", *args,
                    "--nproc-per-node", "2"], timeout=timeout, env=env, cwd=tmp_path)


@pytest.mark.slow
def test_nan_loss_stops_every_rank_with_exit_3_and_a_restart_ends_at_once(ranks, tmp_path):
    # 2 ranks: 23 steps an epoch; NaN from step 30; saves every 10 steps.
    code, _, err = cli(ranks, tmp_path, NAN, "trainer.epochs=4", "checkpoint.every_steps=10", "checkpoint.stop_check_every=4",
                       "--max-restarts", "1", env={NAN_FROM_ENV: "30"})
    assert code == 3, err
    first = [line for line in err.splitlines() if line.startswith("ddpx: error: training diverged:")]
    assert "the loss went non-finite between optimizer steps 29 and 32 (epoch 1)" in first[0]
    newest = checkpoints(tmp_path).checkpoints()[-1]
    assert newest[0] == 30 and f"newest checkpoint with finite weights: {newest[1]}" in first[0]
    assert_finite_checkpoint(newest[1])
    assert "(restart 1 stops at once)" in first[-1]  # torchrun's restart did not train again
    assert err.rstrip().splitlines()[-1] == "ddpx: error: training diverged (the reason is printed above)"
    # A new launch (the cause fixed) resumes from the newest finite checkpoint and finishes.
    code, _, err = cli(ranks, tmp_path, "trainer.epochs=4")
    assert code == 0, err
    assert f"resumed from {newest[1]} (epoch 1, step 30)" in err
    assert not (tmp_path / "run" / "checkpoints" / "diverged.json").exists()


@pytest.mark.slow
def test_lr_too_high_from_the_first_step_writes_no_checkpoint(ranks, tmp_path):
    code, _, err = cli(ranks, tmp_path, "trainer.epochs=3", "optimizer.args={lr: 1.0e+6, momentum: 0.9}")
    assert code == 3, err
    assert "no checkpoint with finite weights exists" in err
    assert checkpoints(tmp_path).checkpoints() == []


@pytest.mark.slow
def test_early_stopping_on_two_ranks_resumes_in_the_middle_of_its_patience(ranks, tmp_path):
    # best 0.9 at epoch 2, then no improvement: with patience 3 the run stops after epoch 5.
    env = {SCORES_ENV: json.dumps([0.1, 0.5, 0.9, 0.8, 0.85, 0.7, 0.95, 0.99, 1.0, 1.0])}
    common = ["plugins.enable=[sample_plugins.ScriptedScore]", "early_stopping.monitor=score",
              "early_stopping.patience=3", "trainer.eval_every_epochs=0"]
    code, _, err = cli(ranks, tmp_path, "trainer.epochs=5", *common, env=env)  # ends after epoch 4 with wait 2
    assert code == 0, err
    assert [r["early_stopping_wait"] for r in read_epoch_lines(tmp_path)] == [0, 0, 0, 1, 2]
    code, _, err = cli(ranks, tmp_path, "trainer.epochs=10", *common, env=env)
    assert code == 0, err
    epochs = read_epoch_lines(tmp_path)
    assert [r["epoch"] for r in epochs] == [0, 1, 2, 3, 4, 5]  # a fresh patience would have gone on to epoch 6
    assert epochs[-1]["early_stopping_wait"] == 3 and epochs[-1]["early_stopped"] is True
    assert "training ended after epoch 5: early stopping: score has not improved" in err
    # Started again on the finished run, it trains no further.
    code, _, err = cli(ranks, tmp_path, "trainer.epochs=10", *common, env=env)
    assert code == 0, err
    assert len(read_epoch_lines(tmp_path)) == 6


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_the_finiteness_scan_finds_one_bad_value_in_any_dtype_and_ignores_large_finite_ones(bad):
    from ddpx_plugins.checkpoint.finite import all_finite, nonfinite_weights

    cpu = torch.device("cpu")
    model = {"w": torch.full((64, 3), 3e38), "h": torch.ones(5, dtype=torch.float16), "b": torch.zeros(7, dtype=torch.bfloat16),
             "empty": torch.empty(0), "count": torch.tensor(3), "name": "not a tensor"}
    assert bool(all_finite([model["w"], model["h"], model["b"], model["empty"]], cpu))  # 3e38: finite, no overflow
    checkpoint = {"replicated": {"model": model}}
    assert nonfinite_weights(checkpoint) is None
    model["h"][3] = bad
    assert not bool(all_finite([model["w"], model["h"], model["b"]], cpu))
    assert nonfinite_weights(checkpoint) == "its weights are non-finite (h)"

"""Checkpoint files: atomic writes, kills mid-write, keep-K, corrupt files, async snapshots."""

import logging
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import harness
from ddpx.rank.checkpoint_files import (
    LATEST,
    AsyncCheckpointWriter,
    CheckpointDirectory,
    atomic_write,
    rng_state,
    set_rng_state,
    snapshot,
)


def _state(step):
    return {"step": step, "weight": torch.full((64, 64), float(step))}


def _leftover_temp_files(directory):
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


def test_atomic_write_replaces_and_leaves_no_temp_file(tmp_path):
    target = tmp_path / "f.bin"
    atomic_write(target, lambda f: f.write(b"old"))
    atomic_write(target, lambda f: f.write(b"new"))
    assert target.read_bytes() == b"new"
    assert _leftover_temp_files(tmp_path) == []


def test_serializer_raising_keeps_previous_checkpoint(tmp_path):
    ckpts = CheckpointDirectory(tmp_path, keep=3)
    ckpts.save(_state(1), step=1)
    with pytest.raises(Exception):
        ckpts.save({"step": 2, "bad": lambda: None}, step=2)  # lambdas do not pickle
    path, state = ckpts.load_latest()
    assert state["step"] == 1 and path == ckpts.path_for(1)
    assert (tmp_path / LATEST).read_text().strip() == path.name
    assert _leftover_temp_files(tmp_path) == []
    assert not ckpts.path_for(2).exists()


@pytest.mark.slow
def test_sigkill_during_write_keeps_previous_checkpoint(tmp_path):
    ckpts = CheckpointDirectory(tmp_path, keep=3)
    ckpts.save(_state(1), step=1)
    started = tmp_path / "started"
    # A writer that is SIGKILLed after writing part of step 2 (no cleanup can run).
    script = textwrap.dedent(
        f"""
        import pathlib, time, torch
        from ddpx.rank.checkpoint_files import CheckpointDirectory
        def slow_save(obj, f):
            f.write(b"PK" + b"x" * 100000)
            f.flush()
            pathlib.Path({str(started)!r}).touch()
            time.sleep(60)
        torch.save = slow_save
        CheckpointDirectory(pathlib.Path({str(tmp_path)!r})).save({{"step": 2}}, step=2)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        assert harness.wait_for(lambda: started.exists() or proc.poll() is not None, 60), "writer never started"
        assert proc.poll() is None, "writer exited before the kill"
        proc.send_signal(signal.SIGKILL)
        assert harness.wait_for(lambda: proc.poll() is not None, 30) and proc.returncode == -signal.SIGKILL
    finally:
        proc.kill()
    assert _leftover_temp_files(tmp_path)  # the half-written temp file is really there
    assert not ckpts.path_for(2).exists()  # ... and never under the final name
    assert (tmp_path / LATEST).read_text().strip() == ckpts.path_for(1).name
    path, state = ckpts.load_latest()
    assert state["step"] == 1 and torch.equal(state["weight"], _state(1)["weight"])
    ckpts.save(_state(3), step=3)  # the next save cleans the dead writer's temp file
    assert _leftover_temp_files(tmp_path) == []
    assert ckpts.load_latest()[1]["step"] == 3


def test_keeps_only_last_k(tmp_path):
    ckpts = CheckpointDirectory(tmp_path, keep=2)
    for step in (5, 10, 15, 20):
        ckpts.save(_state(step), step=step)
    assert [s for s, _ in ckpts.checkpoints()] == [15, 20]
    assert (tmp_path / LATEST).read_text().strip() == ckpts.path_for(20).name


def test_corrupt_latest_is_skipped_with_warning(tmp_path, caplog):
    ckpts = CheckpointDirectory(tmp_path, keep=3)
    ckpts.save(_state(1), step=1)
    ckpts.save(_state(2), step=2)
    newest = ckpts.path_for(2)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated
    with caplog.at_level(logging.WARNING, logger="ddpx.rank.checkpoint_files"):
        path, state = ckpts.load_latest()
    assert state["step"] == 1 and path == ckpts.path_for(1)
    assert "skipping unreadable checkpoint" in caplog.text and newest.name in caplog.text


def test_missing_or_garbage_pointer_falls_back_to_newest_file(tmp_path):
    ckpts = CheckpointDirectory(tmp_path, keep=3)
    assert ckpts.load_latest() is None
    ckpts.save(_state(1), step=1)
    ckpts.save(_state(2), step=2)
    (tmp_path / LATEST).write_text("../../etc/passwd\n")
    assert ckpts.load_latest()[1]["step"] == 2
    (tmp_path / LATEST).unlink()
    assert ckpts.load_latest()[1]["step"] == 2


def test_not_a_checkpoint_is_skipped(tmp_path):
    ckpts = CheckpointDirectory(tmp_path, keep=3)
    ckpts.save(_state(1), step=1)
    torch.save({"step": 9}, ckpts.path_for(9))  # loads, but was not written by ddpx
    assert ckpts.load_latest()[1]["step"] == 1


def test_async_save_snapshots_before_returning(tmp_path):
    writer = AsyncCheckpointWriter(CheckpointDirectory(tmp_path, keep=3), async_write=True)
    model = torch.nn.Linear(256, 256)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    writer.save({"model": model.state_dict()}, step=1)
    with torch.no_grad():  # training goes on while the write is in flight
        for p in model.parameters():
            p.add_(1.0)
    writer.wait()
    state = CheckpointDirectory(tmp_path).load_latest()[1]
    for k, v in expected.items():
        assert torch.equal(state["model"][k], v)
    model.load_state_dict(state["model"])  # state_dict metadata survived the snapshot


def test_async_write_error_is_raised_on_wait(tmp_path):
    writer = AsyncCheckpointWriter(CheckpointDirectory(tmp_path, keep=3), async_write=True)
    writer.save({"step": 1}, step=1)
    writer.wait()
    (tmp_path / "step-000000002.pt").mkdir()  # os.replace onto a directory fails
    writer.save({"step": 2}, step=2)
    with pytest.raises(RuntimeError, match="checkpoint write failed"):
        writer.wait()
    writer.wait()  # reported once
    assert CheckpointDirectory(tmp_path).load_latest()[1]["step"] == 1


def test_snapshot_copies_nested_tensors_and_leaves():
    inner = torch.arange(4.0)
    original = {"a": [inner, (1, "x")], "b": {"n": 3}}
    copied = snapshot(original)
    inner.add_(10)
    original["b"]["n"] = 4
    assert torch.equal(copied["a"][0], torch.arange(4.0))
    assert copied["a"][1] == (1, "x") and copied["b"]["n"] == 3


def test_rng_state_round_trip():
    np = pytest.importorskip("numpy")
    state = rng_state()
    first = (torch.rand(3), random.random(), np.random.rand())
    set_rng_state(state)
    second = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(first[0], second[0]) and first[1:] == second[1:]


def test_linear_lr_scaling_scales_optimizer_and_scheduler_base():
    from types import SimpleNamespace

    from ddpx_plugins.checkpoint.resume import scale_lr

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    scale_lr(SimpleNamespace(optimizer=optimizer, scheduler=scheduler), 3 / 2)  # 2 ranks -> 3
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.15)
    assert scheduler.get_last_lr() == [pytest.approx(0.15)]
    optimizer.step()
    scheduler.step()  # LambdaLR recomputes from base_lrs: they must be scaled too
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.075)


@pytest.mark.parametrize(
    "key, value, message",
    [("every_steps", -1, "every_steps must be >= 0"), ("keep", 0, "keep must be >= 1"),
     ("lr_scaling", "sqrt", "lr_scaling must be one of none, linear"),
     ("stop_timeout_s", 0.0, "stop_timeout_s must be > 0"),
     ("stop_check_every", -1, "stop_check_every must be >= 0"), ("stop_check_s", 0.0, "stop_check_s must be > 0")],
)
def test_bad_checkpoint_config_is_a_one_line_error(key, value, message):
    from types import SimpleNamespace

    from ddpx.errors import DdpxError
    from ddpx_plugins.checkpoint import CheckpointPlugin

    plugin = CheckpointPlugin()
    section = {**plugin.ddpx_config_defaults()["checkpoint"], key: value}
    with pytest.raises(DdpxError, match=message):
        plugin.ddpx_configure(SimpleNamespace(section=lambda name: section))


def test_consecutive_async_saves_reusing_buffers_keep_each_checkpoint_intact(tmp_path):
    directory = CheckpointDirectory(tmp_path, keep=3)
    writer = AsyncCheckpointWriter(directory, async_write=True)
    weight = torch.zeros(256, 256)
    for step in (1, 2, 3):  # each save reuses the CPU buffers of the one before
        weight.fill_(step)
        writer.save({"w": weight}, step)
    writer.wait()
    for step in (1, 2, 3):
        saved = torch.load(directory.path_for(step), weights_only=False)["w"]
        assert torch.equal(saved, torch.full((256, 256), float(step))), step


def _stop_agreement(**cfg):
    """The trainer's stop agreement with the checkpoint plugin's settings, on a stand-in trainer."""
    from types import SimpleNamespace

    from ddpx.train.stopping import StopAgreement
    from ddpx_plugins.checkpoint import CheckpointPlugin

    cfg = {**CheckpointPlugin().ddpx_config_defaults()["checkpoint"], **cfg}
    trainer = SimpleNamespace(global_step=0, world_size=1, rank=0, device=torch.device("cpu"))
    stops = StopAgreement(trainer, cfg["stop_check_every"], cfg["stop_check_s"], cfg["stop_timeout_s"],
                          "checkpoint.stop_timeout_s", "a final checkpoint")
    return stops, trainer  # no loss window: no loss is non-finite


def test_stop_check_interval_fixed_or_from_the_slowest_step():
    stops, _ = _stop_agreement(stop_check_every=7)
    assert [stops.interval(s) for s in (None, 1e-4, 5.0)] == [7, 7, 7]
    stops, _ = _stop_agreement(stop_check_s=1.0)  # auto
    assert stops.interval(None) == 10  # before any step time is known
    assert stops.interval(0.01) == 100
    assert stops.interval(3.0) == 1  # slow steps: every boundary
    assert stops.interval(1e-7) == 1000  # capped


def _stop_agreement_worker(rank, world_size, signal_at, step_s):
    """Each rank runs boundaries at its own pace; one rank gets the signal."""
    stops, trainer = _stop_agreement(stop_check_s=0.05)
    trainer.world_size = world_size
    checks = []
    for step in range(1, 400):
        time.sleep(step_s[rank])
        trainer.global_step = step
        if rank == 1 and step == signal_at:
            stops.signal_received = signal.SIGTERM
        before = stops.next_check
        if stops.check(trainer):
            return {"stopped_at": step, "checks": checks}
        if stops.next_check != before:
            checks.append(step)
    return {"stopped_at": None, "checks": checks}


def test_ranks_agree_to_stop_at_the_same_step_with_intervals_from_the_slowest_rank(ranks):
    # rank 0 takes 5 ms a step, rank 1 1 ms: auto checks every 0.05 s / 5 ms = 10 steps
    r0, r1 = ranks.call(_stop_agreement_worker, 2, args=(25, [0.005, 0.001]), timeout=120)
    assert r0 == r1, (r0, r1)
    assert r0["checks"][0] == 10  # the first interval, before any step time is known
    gaps = [b - a for a, b in zip(r0["checks"], r0["checks"][1:])]
    # about 0.05 s / 5 ms: the slower rank's pace (rank 1's would be 50); fewer where a busy
    # machine stretches the sleeps
    assert gaps and all(1 <= gap <= 10 for gap in gaps), gaps
    # the signal (step 25) is voted at the next check and acted on at the one after
    voted = next(step for step in r0["checks"] if step >= 25)
    assert r0["checks"][-1] == voted and 1 <= r0["stopped_at"] - voted <= 10, r0


def test_stop_watchdog_waits_while_steps_advance_and_gives_up_once_they_stop():
    stops, trainer = _stop_agreement(stop_timeout_s=0.5)
    gave_up = []
    stops.give_up = lambda signum: gave_up.append((signum, time.monotonic(), harness.clock()))
    stops.signal_received = signal.SIGTERM
    stops.arm_stop_deadline()
    start = time.monotonic()
    while time.monotonic() - start < 1.5:  # three timeouts of steady progress
        trainer.global_step += 1
        time.sleep(0.05)
    assert not gave_up
    stalled, stalled_on_clock = time.monotonic(), harness.clock()
    assert harness.wait_for(lambda: gave_up, 5, poll=0.01) and gave_up[0][0] == signal.SIGTERM
    # the timeout after the last step (the watchdog counts wall seconds), give or take a poll
    assert gave_up[0][1] - stalled >= 0.4 and gave_up[0][2] - stalled_on_clock <= 1.5, gave_up

    gave_up.clear()
    stops.arm_stop_deadline()
    stops.stop_agreed()  # a stop agreed in time ends the watchdog
    time.sleep(1.0)
    assert not gave_up


def test_a_checkpoint_of_another_model_is_one_line_naming_the_file(make_config, tmp_path):
    from ddpx.errors import DdpxError
    from ddpx.train.trainer import Trainer

    Trainer(make_config("trainer.epochs=1")).run()
    with pytest.raises(DdpxError, match=r"checkpoint .*step-0+\d+\.pt holds another model's weights \(Error\(s\) in "
                                        r"loading state_dict for DigitsMLP: size mismatch for net.0.weight.*resume it "
                                        r"with the model it was saved with"):
        Trainer(make_config("trainer.epochs=2", "model.args.hidden=32")).run()

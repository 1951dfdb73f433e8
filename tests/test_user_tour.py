"""What a new user met on a first tour (issue 28, finding 6 and the first README command)."""

import errno
import runpy
import sys
import types
from pathlib import Path

import pytest
import torch

from ddpx.rank.checkpoint_files import AsyncCheckpointWriter, CheckpointDirectory
from ddpx.errors import DdpxError

ROOT = Path(__file__).resolve().parents[1]


def test_a_full_disk_is_one_line_with_the_size_needed(tmp_path):
    class FullDisk(CheckpointDirectory):
        def save(self, state, step, score=None):
            try:  # as torch.save fails on a full disk: its zip writer's error on top of the OSError
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 77056 vs 77008")

    for async_write in (True, False):
        writer = AsyncCheckpointWriter(FullDisk(tmp_path), async_write=async_write)
        with pytest.raises(DdpxError) as info:
            writer.save({"w": torch.zeros(3, 2**20)}, step=1)  # 12 MB
            writer.wait()
        message = str(info.value)
        assert "\n" not in message
        assert message.startswith("checkpoint not saved: no space left on device") and "(needs about 12 MB)" in message


def test_a_worker_crash_exits_1_and_bad_input_found_by_a_worker_exits_2(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from ddpx.launch.torchrun import WorkerCrashed, _run_agent

    args = types.SimpleNamespace(local_addr=None, nproc_per_node="2")
    for code, kind, exit_code in ((1, WorkerCrashed, 1), (2, DdpxError, 2), (-9, WorkerCrashed, 1)):
        def run(_):
            raise ChildFailedError("ddpx.worker", {0: ProcessFailure(0, 4242, code, str(tmp_path / "none"))})

        with pytest.raises(kind) as info:
            _run_agent(run, args, str(tmp_path))
        assert info.value.exit_code == exit_code and "training failed: rank 0 (pid 4242)" in str(info.value)


def test_a_run_that_does_not_finish_prints_the_command_that_resumes_it(tmp_path, monkeypatch, capsys):
    from ddpx.launch import launcher
    from ddpx.launch.options import LaunchOptions
    from ddpx.launch.resume import newest_run

    def stopped_after_a_checkpoint(argv):  # stopped by SIGTERM
        run_dir = Path(next(a for a in argv if a.startswith("run_dir=")).split("=", 1)[1])
        (run_dir / "checkpoints").mkdir()
        torch.save({}, run_dir / "checkpoints" / "step-000000005.pt")
        return 143

    monkeypatch.setattr(launcher, "run_torchrun", stopped_after_a_checkpoint)
    config = tmp_path / "cfg.yaml"
    config.write_text("trainer: {epochs: 1}\n")
    monkeypatch.chdir(tmp_path)
    assert launcher.launch(str(config), ["trainer.epochs=2"], LaunchOptions(nproc_per_node="1")) == 143
    last = capsys.readouterr().err.strip().splitlines()[-1]
    run_dir = next((tmp_path / "runs").iterdir())
    assert last == f"ddpx: to resume this run: ddpx train {config} trainer.epochs=2 run_dir={run_dir}"
    assert newest_run(str(config)) == str(run_dir)  # what --resume finds


def test_the_smoke_run_fails_on_zero_steps_or_a_nonfinite_loss():
    from ddpx.smoke.rank import _train_steps

    class Stub:
        global_step, last_loss, epoch = 0, None, 0

        def train(self, until_step):
            pass

    with pytest.raises(RuntimeError, match="0 optimizer steps"):
        _train_steps(Stub(), 3)
    stub = Stub()
    stub.train = lambda until_step: setattr(stub, "global_step", 3) or setattr(stub, "last_loss", torch.tensor(float("nan")))
    with pytest.raises(RuntimeError, match="3 optimizer steps, but the last loss is nan"):
        _train_steps(stub, 3)


def test_make_shapes_without_pillow_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "PIL", None)  # as if Pillow were not installed
    monkeypatch.setattr(sys, "argv", ["make_shapes.py", str(tmp_path / "shapes")])
    with pytest.raises(SystemExit) as info:
        runpy.run_path(str(ROOT / "examples" / "resnet_images" / "make_shapes.py"), run_name="__main__")
    assert "needs Pillow: pip install pillow" in str(info.value) and "[examples]" in str(info.value)


def test_shapes_output_is_git_ignored():
    ignored = (ROOT / ".gitignore").read_text().split()
    assert "shapes/" in ignored


def test_scheduler_sized_in_steps_is_warned_about_after_a_world_size_change(caplog):
    import logging

    from ddpx.config import load_config
    from ddpx.data.sampler import ResumableDistributedBatchSampler
    from ddpx.plugin.shared import Shared
    from ddpx_plugins.checkpoint.resume import run_steps, warn_scheduler_horizon

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    trainer = types.SimpleNamespace(
        scheduler=torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100), global_step=0, epoch=0,
        train_loader=types.SimpleNamespace(batch_sampler=ResumableDistributedBatchSampler(1000, 10, 0, 2)),
        config=load_config(None, ["trainer.epochs=3"]), world_size=2, shared=Shared(),
        log=logging.getLogger("ddpx.test"))
    assert run_steps(trainer) == 150  # 3 epochs x 1000 / (2 x 10)
    with caplog.at_level("WARNING", logger="ddpx.test"):
        warn_scheduler_horizon(trainer)
    assert "T_max=100 counts optimizer steps, but at 2 ranks this run takes 150" in caplog.text
    assert "scheduler.args.T_max=150" in caplog.text


def test_the_epoch_end_checkpoint_names_the_epoch_that_ended(make_config, capfd):
    from ddpx.train.trainer import Trainer

    Trainer(make_config("trainer.epochs=1", "trainer.eval_every_epochs=0", "checkpoint.async_write=false")).run()
    err = capfd.readouterr().err
    assert "epoch 0 (step 45)" in err and "(end of epoch 0, step 45)" in err and "(epoch 1, step 45)" not in err


def test_resume_followed_by_an_override_resumes_the_newest_run_with_it(tmp_path, monkeypatch, capsys):
    """`ddpx train cfg.yaml --resume trainer.epochs=31`: argparse hands the override to
    --resume as its RUN_DIR; it must stay an override, and the newest run is resumed."""
    import ddpx.cli.train as train_command
    from ddpx import cli

    launched = []
    monkeypatch.setattr(train_command, "launch", lambda config, overrides, opts: launched.append(overrides) or 0)
    config = tmp_path / "cfg.yaml"
    config.write_text("trainer: {epochs: 1}\n")
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "r1"
    monkeypatch.setattr(train_command, "newest_run", lambda config_path: str(run_dir))
    run_dir.mkdir(parents=True)
    assert cli.main(["train", str(config), "--resume", "trainer.epochs=31"]) == 0
    assert launched == [["trainer.epochs=31", f"run_dir={run_dir}"]]
    assert cli.main(["train", str(config), "--resume", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "no such run directory" in err and "nope" in err

"""Checkpoints cannot run code: every load is weights-only; what ddpx writes is plain data."""

import logging
import os

import pytest
import torch

from ddpx.rank.checkpoint_files import CheckpointDirectory, UnsafeCheckpoint, check_plain, load_file, rng_state
from ddpx.errors import DdpxError
from ddpx.train.trainer import Trainer


class Payload:
    """Unpickling this creates ``marker``: what a hostile checkpoint would do instead."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def write_malicious(path, marker, **extra):
    torch.save({"ddpx_checkpoint_format": 2, "step": 99, "x": Payload(marker), **extra}, path)


def test_a_malicious_file_is_refused_in_one_line_and_nothing_runs(tmp_path):
    marker = tmp_path / "pwned"
    write_malicious(tmp_path / "step-000000099.pt", marker)
    with pytest.raises(UnsafeCheckpoint) as info:
        load_file(tmp_path / "step-000000099.pt")
    message = str(info.value)
    assert "\n" not in message and "step-000000099.pt" in message and "io.open" in message
    assert not marker.exists()


def test_resume_falls_back_to_the_previous_checkpoint(tmp_path, caplog):
    marker = tmp_path / "pwned"
    ckpts = CheckpointDirectory(tmp_path, keep=3)
    ckpts.save({"step": 1, "w": torch.ones(2)}, step=1)
    write_malicious(ckpts.path_for(2), marker)
    (tmp_path / "latest").write_text(ckpts.path_for(2).name + "\n")
    with caplog.at_level(logging.WARNING, logger="ddpx.rank.checkpoint_files"):
        path, state = ckpts.load_latest()
    assert path == ckpts.path_for(1) and state["step"] == 1
    assert "refusing checkpoint" in caplog.text and "io.open" in caplog.text
    assert not marker.exists()


def test_only_a_malicious_checkpoint_stops_the_run(make_config, tmp_path):
    marker = tmp_path / "pwned"
    directory = tmp_path / "run" / "checkpoints"
    directory.mkdir(parents=True)
    write_malicious(directory / "step-000000005.pt", marker)
    with pytest.raises(DdpxError, match="no checkpoint in .* can be resumed .*step-000000005.pt: not plain data"):
        Trainer(make_config("trainer.epochs=1", "trainer.max_steps=2")).run()
    assert not marker.exists()
    assert [p.name for p in directory.iterdir()] == ["step-000000005.pt"]  # nothing overwritten


def test_a_run_writes_only_plain_data(make_config, tmp_path):
    Trainer(make_config("trainer.epochs=1", "trainer.max_steps=3", "trainer.eval_every_epochs=0")).run()
    path = tmp_path / "run" / "checkpoints" / "step-000000003.pt"
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(path)) == []
    state = torch.load(path, weights_only=True)
    assert state["ddpx_checkpoint_format"] == 2 and state["step"] == 3


def test_state_that_is_not_plain_data_is_refused_at_save_naming_its_key(tmp_path):
    class Counter:
        pass

    with pytest.raises(DdpxError, match=r"checkpoint/ranks/0/plugins/mine/c is a .*Counter: checkpoint state must"):
        check_plain({"ranks": [{"plugins": {"mine": {"c": Counter()}}}]})
    with pytest.raises(DdpxError, match="is a .*OrderedDict|is a .*defaultdict"):
        import collections

        check_plain({"d": collections.defaultdict(int)})
    check_plain({"model": torch.nn.Linear(2, 2).state_dict(), "t": (1, 2.0, "x", None, b"y", torch.float16)})


def test_numpy_rng_state_is_saved_as_plain_data_and_restores():
    np = pytest.importorskip("numpy")
    np.random.seed(3)
    state = rng_state()
    check_plain(state)
    first = np.random.rand(3)
    from ddpx.rank.checkpoint_files import set_rng_state

    set_rng_state(state)
    assert (np.random.rand(3) == first).all()


def test_only_the_current_format_is_resumed(tmp_path, caplog):
    ckpts = CheckpointDirectory(tmp_path, keep=3)
    ckpts.save({"step": 1, "w": torch.ones(2)}, step=1)
    torch.save({"ddpx_checkpoint_format": 1, "step": 2}, ckpts.path_for(2))  # a development version's format
    (tmp_path / "latest").write_text(ckpts.path_for(2).name + "\n")
    with caplog.at_level(logging.WARNING, logger="ddpx.rank.checkpoint_files"):
        path, state = ckpts.load_latest()
    assert path == ckpts.path_for(1) and state["step"] == 1
    assert "not a ddpx checkpoint (format 1)" in caplog.text


@pytest.mark.slow
def test_two_ranks_refuse_a_malicious_checkpoint(ranks, tmp_path):
    marker = tmp_path / "pwned"
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    write_malicious(run_dir / "checkpoints" / "step-000000005.pt", marker)
    (run_dir / "checkpoints" / "latest").write_text("step-000000005.pt\n")
    config = tmp_path / "c.yaml"
    config.write_text(f"run_dir: {run_dir}\ntrainer: {{epochs: 1, max_steps: 2}}\nlogging: {{progress: false}}\n")
    code, out, err = ranks.cli(["train", str(config), "--nproc-per-node", "2"], timeout=120)
    assert code == 2, err
    assert "no checkpoint in" in err and "step-000000005.pt: not plain data" in err and "Traceback" not in err
    assert not marker.exists()


@pytest.mark.slow  # six short runs
@pytest.mark.parametrize("hook", ["allreduce", "bf16", "fp16", "int8", "onebit", "powersgd"])
def test_every_comm_hook_state_is_saved_as_plain_data(make_config, tmp_path, hook):
    Trainer(make_config("trainer.epochs=1", "trainer.max_steps=3", "trainer.eval_every_epochs=0",
                        f"comm_hook.name={hook}")).run()
    path = tmp_path / "run" / "checkpoints" / "step-000000003.pt"
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(path)) == []
    state = load_file(path)
    if hook != "allreduce":
        assert state["ranks"][0]["plugins"]["comm_hook"]["state"]["name"] == hook


class NotPlainState:
    """A plugin whose ddpx_state_dict returns an object: refused at the first save, naming the key."""

    from ddpx import hookimpl

    @hookimpl
    def ddpx_state_dict(self, trainer):
        return {"mine": {"counter": NotPlainState}}


def test_a_plugin_state_that_is_not_plain_data_stops_the_first_save(make_config, tmp_path):
    from ddpx.plugin.manager import make_plugin_manager

    pm = make_plugin_manager(None)
    pm.register(NotPlainState(), name="not_plain")
    config = make_config("trainer.epochs=1", "trainer.max_steps=2", "trainer.eval_every_epochs=0",
                         plugin_manager=pm)
    with pytest.raises(DdpxError, match="checkpoint state/mine/counter is a builtins.type: checkpoint state must"):
        Trainer(config).run()
    assert not list((tmp_path / "run" / "checkpoints").glob("step-*.pt"))

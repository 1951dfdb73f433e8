"""The trainer's run lifecycle: max_steps and resume, stop signals, what a run leaves behind."""

import logging
import signal

import pytest
import torch
import torch.distributed as dist

import sample_plugins

from ddpx.train.stopping import TrainingStopped
from ddpx.train.trainer import Trainer

NO_EVAL = "trainer.eval_every_epochs=0"  # these runs do not evaluate
# digits_split(test_fraction=0.2): 1437 training samples, 45 batches of 32 per epoch on one rank
STEPS_PER_EPOCH = 45


def saved_checkpoint(tmp_path):
    from ddpx.rank.checkpoint_files import CheckpointDirectory

    return CheckpointDirectory(tmp_path / "run" / "checkpoints", keep=3).load_latest()[1]


def saved_progress(tmp_path):
    return saved_checkpoint(tmp_path)["replicated"]["progress"]


def test_max_steps_mid_epoch_resumes_the_rest_of_that_epoch(make_config, tmp_path):
    first = Trainer(make_config(NO_EVAL, "trainer.epochs=3", "trainer.max_steps=20")).run()
    assert [(m["epoch"], m["step"]) for m in first] == [(0, 20)]
    assert saved_progress(tmp_path) == {"epoch": 0, "global_step": 20}  # epoch 0 is not finished
    sampler = saved_checkpoint(tmp_path)["ranks"][0]["plugins"]["sampler"]
    assert (sampler["epoch"], sampler["consumed"]) == (0, 20 * 32)  # the batches trained, not those prefetched

    resumed = Trainer(make_config(NO_EVAL, "trainer.epochs=2", "trainer.max_steps=100"))
    metrics = resumed.run()
    # The rest of epoch 0 (25 batches), then all of epoch 1, then stopped by max_steps in epoch 2's absence.
    assert [(m["epoch"], m["step"]) for m in metrics] == [(0, STEPS_PER_EPOCH), (1, 2 * STEPS_PER_EPOCH)]
    assert saved_progress(tmp_path) == {"epoch": 2, "global_step": 2 * STEPS_PER_EPOCH}


def test_max_steps_on_the_last_batch_finishes_the_epoch(make_config, tmp_path):
    Trainer(make_config(NO_EVAL, "trainer.epochs=3", f"trainer.max_steps={STEPS_PER_EPOCH}")).run()
    assert saved_progress(tmp_path) == {"epoch": 1, "global_step": STEPS_PER_EPOCH}


def test_a_run_restores_the_logger_and_signal_handlers(make_config, tmp_path):
    logger = logging.getLogger("ddpx")
    before = (list(logger.handlers), logger.level, logger.propagate)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    Trainer(make_config(NO_EVAL, "trainer.epochs=1", "trainer.max_steps=2")).run()
    assert (list(logger.handlers), logger.level, logger.propagate) == before
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers


@pytest.mark.parametrize("signum, checkpoint", [(signal.SIGTERM, False), (signal.SIGTERM, True),
                                               (signal.SIGHUP, True)])  # SIGHUP: a closed terminal
def test_a_stop_signal_stops_the_run_cleanly(make_config, tmp_path, signum, checkpoint, capfd):
    # the signal at its default, as in a terminal, also where the suite runs under nohup (SIGHUP
    # ignored: the trainer then keeps it ignored, as
    # test_under_nohup_sighup_stays_ignored_in_the_launcher_agent_and_the_rank checks)
    outer = signal.signal(signum, signal.SIG_DFL)
    try:
        _stop_signal_run(make_config, tmp_path, signum, checkpoint, capfd)
    finally:
        signal.signal(signum, outer)


def _stop_signal_run(make_config, tmp_path, signum, checkpoint, capfd):
    previous = signal.getsignal(signum)
    sender = "SigtermAtBatch" if signum == signal.SIGTERM else "SighupAtBatch"
    overrides = ["trainer.epochs=2", f"plugins.enable=[sample_plugins.{sender}]"]
    overrides.append("checkpoint.stop_check_every=5" if checkpoint else "plugins.block=[checkpoint]")
    trainer = None
    with pytest.raises(TrainingStopped) as stopped:
        trainer = Trainer(make_config(NO_EVAL, *overrides))
        trainer.run()
    assert stopped.value.signum == signum
    assert not dist.is_initialized()
    assert signal.getsignal(signum) == previous
    if checkpoint:
        # Agreed stop at the next check (step 5) with a final checkpoint.
        assert trainer.global_step == 5
        assert saved_progress(tmp_path)["global_step"] == 5
        name = signal.Signals(signum).name
        assert f"[rank0] ddpx: received {name}: stopping within 10 optimizer steps" in capfd.readouterr().err
    else:
        # No plugin can agree on a stop across ranks: the rank stops at once, saying why.
        assert trainer.global_step == 3
        assert "no plugin agrees on a stop across ranks" in str(stopped.value)
        assert not (tmp_path / "run" / "checkpoints").exists()
    assert torch.is_grad_enabled()


def test_under_nohup_sighup_stays_ignored_in_the_launcher_agent_and_the_rank():
    """``nohup ddpx train ... &``: the SIGHUP of a closed terminal must not stop the run. torchrun's
    agent would take it (and forward it) by default; the trainer takes it only where it is not ignored."""
    from ddpx.launch.torchrun import SIGNALS_ENV, agent_signals
    from ddpx.train.stopping import StopSignals

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert agent_signals() == {SIGNALS_ENV: "SIGTERM,SIGINT,SIGQUIT"}
        handlers = StopSignals(trainer=None)
        handlers.install()
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == signal.getsignal(signal.SIGINT) == handlers.on_signal
        handlers.restore()
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        assert agent_signals() == {}  # torchrun's own default: SIGHUP stops the run
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_batch_end_runs_for_each_micro_batch_in_pluggy_order_with_its_arguments(make_config, tmp_path):
    """Each micro-batch's batch-end implementations, after its window's step, in pluggy's
    order (tryfirst, plain, trylast), each with the subset of arguments it asks for."""
    plugins = "plugins.enable=[sample_plugins.LastAtBatchEnd,sample_plugins.SubsetAtBatchEnd,sample_plugins.FirstAtBatchEnd]"
    calls = sample_plugins.EVENTS
    calls.clear()
    Trainer(make_config(NO_EVAL, "trainer.epochs=1", "trainer.max_steps=3", "accumulation.steps=2",
                        "checkpoint.enabled=false", plugins, run_dir=tmp_path / "run")).run()
    assert [call[0] for call in calls] == ["first", "subset", "last"] * 6  # 3 steps of 2 micro-batches
    assert [call[1:3] for call in calls[:6:3]] == [(0, False), (1, True)]  # batch index, stepped
    assert calls[1] == ("subset", False, 1) and calls[4] == ("subset", True, 1)  # both after step 1
    assert calls[0][4] == calls[2][2]  # the same loss reaches both


def test_the_lifecycle_in_steps_trains_what_one_run_trains(make_config, tmp_path):
    """setup, train(until_step) twice (a pause inside epoch 0 goes on with the same
    batches), finish, close: the same weights and epoch metrics as run()."""
    common = [NO_EVAL, "trainer.epochs=2", "trainer.max_steps=60", "checkpoint.enabled=false"]
    whole = Trainer(make_config(*common, run_dir=tmp_path / "whole"))
    whole.run()
    with Trainer(make_config(*common, run_dir=tmp_path / "steps")) as steps:
        steps.setup()
        steps.train(until_step=20)
        assert (steps.global_step, steps.epoch, steps.epoch_finished, steps.metrics) == (20, 0, False, [])
        steps.train()  # the rest of epoch 0, then epoch 1 up to max_steps
        steps.finish()
    assert not dist.is_initialized()
    assert steps.global_step == whole.global_step == 60
    assert [(m["epoch"], m["step"]) for m in steps.metrics] == [(0, STEPS_PER_EPOCH), (1, 60)]
    assert [m["loss"] for m in steps.metrics] == pytest.approx([m["loss"] for m in whole.metrics], rel=1e-6)
    for a, b in zip(steps.module.parameters(), whole.module.parameters()):
        torch.testing.assert_close(a, b)
    steps.close()  # again: nothing happens

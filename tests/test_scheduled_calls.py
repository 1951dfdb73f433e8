"""Calls scheduled with ``trainer.call_at_step`` and the trainer's loss windows:
the way plugins act now and then without a per-step hook."""

import json

import pytest

import sample_plugins
from ddpx.train.trainer import Trainer

NO_EVAL = "trainer.eval_every_epochs=0"  # these runs do not evaluate

def test_calls_run_at_optimizer_step_boundaries_in_the_order_scheduled(make_config, tmp_path):
    events = sample_plugins.EVENTS
    events.clear()
    Trainer(make_config(NO_EVAL, "trainer.epochs=1", "trainer.max_steps=8", "accumulation.steps=2",
                        "checkpoint.enabled=false", "plugins.enable=[sample_plugins.Scheduler]")).run()
    calls = [event[1:] for event in events if event[0] == "call"]
    # (name, global_step, batch index): steps end on odd batches with 2 micro-batches per step
    assert calls == [("c", 1, 1), ("b", 3, 5), ("a", 3, 5), ("a-again", 4, 7), ("late", 7, 13)]
    # each call runs after its step's batch-end hooks, before the next step (whose
    # micro-batches' batch-end hooks run once that step is done)
    at = events.index(("call", "b", 3, 5))
    assert events[at - 2:at] == [("batch_end", 4, 3), ("batch_end", 5, 3)]
    assert events[at + 2:at + 4] == [("batch_end", 6, 4), ("batch_end", 7, 4)]


@pytest.mark.parametrize("fold", [4096, 4])  # 4: the trainer folds kept losses many times an epoch
def test_step_lines_and_epoch_losses_are_exact_means_of_the_micro_batch_losses(make_config, tmp_path, monkeypatch, capfd, fold):
    import ddpx.train.losses

    monkeypatch.setattr(ddpx.train.losses, "FOLD_AT", fold)
    monkeypatch.setattr("ddpx_plugins.logging.progress.on_terminal", lambda stream=None: True)  # the bar
    events = sample_plugins.EVENTS
    events.clear()
    # 45 micro-batches an epoch, 3 per step: 15 steps an epoch; a step line every 4 steps spans epochs
    metrics = Trainer(make_config(NO_EVAL, "trainer.epochs=2", "accumulation.steps=3", "logging.every_steps=4",
                                  "logging.progress=true", "checkpoint.enabled=false",
                                  "plugins.enable=[sample_plugins.LossRecorder]")).run()
    assert len(events) == 90 and sum(stepped for _, _, stepped, _ in events) == 30

    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step_lines = [line for line in lines if line["kind"] == "step"]
    assert [line["step"] for line in step_lines] == [4, 8, 12, 16, 20, 24, 28]
    assert [line["epoch"] for line in step_lines] == [0, 0, 0, 1, 1, 1, 1]
    window = []
    expected = []
    for epoch, step, stepped, loss in events:
        window.append(loss)
        if stepped and step % 4 == 0:
            expected.append(sum(window) / len(window))
            window = []
    assert [line["loss"] for line in step_lines] == pytest.approx(expected, rel=1e-12)
    assert all(line["samples_per_s"] > 0 for line in step_lines)

    for epoch in (0, 1):
        losses = [loss for e, _, _, loss in events if e == epoch]
        assert metrics[epoch]["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-12)
    assert "90/90" in capfd.readouterr().err  # the bar counted every micro-batch once

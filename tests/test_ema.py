"""The EMA plugin: the average against one computed by hand over the same run, exact resume
at another world size, EMA evaluation on the digits default, and the exported weights."""

import json

import pytest
import torch

import sample_plugins
from ddpx.config import load_config
from ddpx.errors import DdpxError
from ddpx.train.trainer import Trainer

NO_EVAL = "trainer.eval_every_epochs=0"


def hand_ema(weights_by_step, decay, start_step, every_steps, last_step):
    """The EMA in plain fp32 arithmetic: a copy of the weights after ``start_step``, then
    ``ema = decay * ema + (1 - decay) * weights`` after every ``every_steps`` steps."""
    ema = [w.clone() for w in weights_by_step[start_step]]
    for step in range(start_step + every_steps, last_step + 1, every_steps):
        ema = [decay * e + (1 - decay) * w for e, w in zip(ema, weights_by_step[step])]
    return ema


@pytest.mark.parametrize("start_step, every_steps", [(0, 1), (3, 2)])
def test_the_average_equals_one_computed_by_hand(make_config, tmp_path, start_step, every_steps):
    sample_plugins.EVENTS.clear()
    trainer = Trainer(make_config(NO_EVAL, "trainer.epochs=1", "trainer.max_steps=12", "ema.decay=0.9",
                                  f"ema.start_step={start_step}", f"ema.every_steps={every_steps}",
                                  "plugins.enable=[sample_plugins.WeightRecorder]"))
    trainer.run()
    weights = dict(sample_plugins.EVENTS)
    expected = hand_ema(weights, 0.9, start_step, every_steps, 12)
    for got, want, last in zip(trainer.plugin("ema").state.params, expected, weights[12]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)  # fp32 round-off: lerp vs the formula above
        assert (got - last).abs().max() > 1e-4  # an average, not the last weights
    assert trainer.plugin("ema").state.updates == len(range(start_step + every_steps, 13, every_steps))

    exported = torch.load(tmp_path / "run" / "ema_weights.pt", weights_only=False)
    assert exported["weights"] == "ema" and exported["decay"] == 0.9 and exported["step"] == 12 - (12 - start_step) % every_steps
    names = [name for name, _ in trainer.module.named_parameters()]
    for name, want in zip(names, expected):
        torch.testing.assert_close(exported["state_dict"][name], want, rtol=1e-6, atol=1e-7)


def test_bad_ema_settings_are_one_line_errors():
    with pytest.raises(DdpxError, match=r"ema.decay must be a number between 0 and 1"):
        load_config(None, ["ema.decay=1.5"])
    with pytest.raises(DdpxError, match=r"ema.every_steps must be >= 1"):
        load_config(None, ["ema.decay=0.9", "ema.every_steps=0"])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_resume_at_another_world_size_continues_the_same_average(ranks, make_config, tmp_path):
    """2 ranks x 16 samples for 8 steps, then 1 rank x 32 from the checkpoint, against 1 rank x 32
    throughout: the same global batches, so the same weights and EMA up to round-off."""
    common = [NO_EVAL, "trainer.epochs=1", "ema.decay=0.8", "ema.every_steps=2", "model.args.hidden=16"]
    whole = Trainer(make_config(*common, "trainer.max_steps=20", run_dir=tmp_path / "whole"))
    whole.run()

    resumed_dir = tmp_path / "resumed"
    rc, out, err = ranks.cli(["train", "--nproc-per-node=2", f"run_dir={resumed_dir}", "logging.progress=false",
                              "trainer.batch_size=16", "trainer.max_steps=8", *common], cwd=tmp_path, timeout=150)
    assert rc == 0, err[-3000:]
    resumed = Trainer(make_config(*common, "trainer.max_steps=20", run_dir=resumed_dir))
    resumed.run()
    resumed_ema, whole_ema = resumed.plugin("ema").state, whole.plugin("ema").state
    assert resumed_ema.updates == whole_ema.updates == 10
    for got, want, raw in zip(resumed_ema.params, whole_ema.params, whole.module.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        # An average restarted at the resume would sit near step 8..20's weights instead.
        assert (want - raw.detach()).abs().max() > 1e-3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_digits_default_reports_ema_accuracy(ranks, tmp_path):
    from ddpx.data import digits_split
    from ddpx.models import DigitsMLP

    run_dir = tmp_path / "run"
    rc, out, err = ranks.cli(["train", "--nproc-per-node=2", f"run_dir={run_dir}", "ema.decay=0.999",
                              "trainer.epochs=3", "logging.progress=false"], cwd=tmp_path, timeout=240)
    assert rc == 0, err[-3000:]
    epochs = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "epoch"]
    assert len(epochs) == 3 and all("ema_accuracy" in r and "ema_eval_loss" in r for r in epochs)
    assert epochs[-1]["accuracy"] > 0.9  # the raw weights learned the digits (0.947 after 3 epochs)
    assert "ema_accuracy" in err  # in the epoch lines on the console

    # The last epoch's ema_accuracy is the accuracy of the exported EMA weights, evaluated by hand.
    exported = torch.load(run_dir / "ema_weights.pt", weights_only=False)
    assert exported["weights"] == "ema" and exported["decay"] == 0.999
    model = DigitsMLP(hidden=128)
    model.load_state_dict(exported["state_dict"])
    _, test = digits_split(test_fraction=0.2, seed=0)
    with torch.no_grad():
        accuracy = (model(test.tensors[0]).argmax(1) == test.tensors[1]).double().mean().item()
    assert epochs[-1]["ema_accuracy"] == pytest.approx(accuracy, abs=1e-9)
    assert 0.0 <= accuracy <= 1.0

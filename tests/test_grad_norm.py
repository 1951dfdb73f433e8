"""The gradient-norm watch: the total gradient norm in the step lines, and the non-finite
guard naming the first parameter whose gradient went non-finite."""

import json

import pytest

import sample_plugins
from ddpx.errors import TrainingDiverged
from ddpx.train.trainer import Trainer

NO_EVAL = "trainer.eval_every_epochs=0"


def step_lines(tmp_path):
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if r["kind"] == "step"]


@pytest.mark.parametrize("clip", [None, 0.5])
def test_step_lines_carry_the_total_gradient_norm_of_their_step(make_config, tmp_path, clip):
    sample_plugins.EVENTS.clear()
    overrides = [NO_EVAL, "trainer.epochs=1", "trainer.max_steps=12", "logging.every_steps=5",
                 "plugins.enable=[sample_plugins.GradNormRecorder]"]
    if clip:
        overrides.append(f"trainer.grad_clip={clip}")
    trainer = Trainer(make_config(*overrides))
    trainer.run()
    reference = dict(sample_plugins.EVENTS)  # step -> torch's total norm before clipping
    lines = step_lines(tmp_path)
    assert [r["step"] for r in lines] == [5, 10]
    for r in lines:
        assert r["grad_norm"] == pytest.approx(reference[r["step"]], rel=1e-6)
    # Without a clip only the logged steps computed a norm; with one, every step did.
    assert trainer.grad_norm_step == (12 if clip else 10)


def test_clipping_with_the_kept_norm_equals_clip_grad_norm(make_config, tmp_path):
    import torch

    trainer = Trainer(make_config(NO_EVAL, "trainer.grad_clip=0.1"))
    with trainer:
        trainer.setup()
        model = trainer.module
        x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
        torch.nn.functional.cross_entropy(model(x), y).backward()
        grads = [p.grad for p in model.parameters()]
        # The reference: torch's clip_grad_norm_ on stand-in parameters holding copies of the gradients.
        stand_ins = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for s, g in zip(stand_ins, grads):
            s.grad = g.clone()
        expected_norm = torch.nn.utils.clip_grad_norm_(stand_ins, 0.1)
        norm = trainer.clip_gradients()
        assert float(norm) == pytest.approx(float(expected_norm), rel=1e-6)
        for g, s in zip(grads, stand_ins):
            torch.testing.assert_close(g, s.grad, rtol=0, atol=0)


@pytest.mark.parametrize("clip", [True, False])
def test_the_guard_names_the_first_parameter_with_a_nonfinite_gradient(make_config, tmp_path, clip):
    overrides = [NO_EVAL, "trainer.epochs=1", "trainer.max_steps=8", "logging.every_steps=0",
                 "plugins.enable=[sample_plugins.NanGradAtStep]"]
    if clip:
        overrides.append("trainer.grad_clip=100.0")
    with pytest.raises(TrainingDiverged) as caught:
        Trainer(make_config(*overrides)).run()
    message = str(caught.value)
    if clip:
        assert "the first non-finite gradient was net.2.weight's, at optimizer step 3" in message
    else:
        assert "set trainer.grad_clip to check every step's gradients" in message

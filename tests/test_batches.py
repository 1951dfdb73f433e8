"""Batches beyond ``(inputs, targets)``: dict batches (Hugging Face style), models
that compute their own loss (``loss.target: null``), a metric function named by
``trainer.eval_metric``. The same training written either way gives the same numbers."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ddpx.config import load_config
from ddpx.data import digits_split
from ddpx.errors import DdpxError
from ddpx.models import DigitsMLP
from ddpx.plugin.manager import make_plugin_manager
from ddpx.data.batches import batch_size, model_loss
from ddpx.train.trainer import Trainer

HERE = "tests.test_batches"


class DictDigits(Dataset):
    def __init__(self, tensors):
        self.tensors = tensors

    def __len__(self):
        return len(self.tensors)

    def __getitem__(self, i):
        x, y = self.tensors[i]
        return {"pixels": x, "labels": y}


def dict_digits(**args):
    train, test = digits_split(**args)
    return DictDigits(train), DictDigits(test)


class SelfLossMLP(DigitsMLP):
    """Returns ``{"loss", "logits"}`` as a Hugging Face model does when given labels."""

    def forward(self, pixels, labels=None):
        logits = super().forward(pixels)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


class TupleLossMLP(DigitsMLP):
    """Takes the whole ``(inputs, targets)`` batch and returns the bare loss."""

    def forward(self, x, y):
        return F.cross_entropy(super().forward(x), y)


class KwargsMLP(DigitsMLP):
    def forward(self, pixels):
        return super().forward(pixels)


def logits_accuracy(outputs, batch):
    return {"top1": (outputs["logits"].argmax(1) == batch["labels"]).double().mean(), "one": 1.0}


def run(tmp_path, name, *overrides):
    pm = make_plugin_manager(None, builtins=False, entry_points=False)  # the trainer alone
    config = load_config(None, [f"run_dir={tmp_path}/{name}", "trainer.epochs=2", "data.args.test_fraction=0.5",
                                "model.args.hidden=32", *overrides], plugin_manager=pm)
    trainer = Trainer(config)
    return trainer.run(), list(trainer.module.parameters())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(tmp_path_factory.mktemp("reference"), "tuple")


@pytest.mark.parametrize("overrides", [
    [f"model.target={HERE}.SelfLossMLP", f"data.target={HERE}.dict_digits", "loss.target=null",
     f"trainer.eval_metric={HERE}.logits_accuracy"],
    [f"model.target={HERE}.TupleLossMLP", "loss.target=null"],
    [f"model.target={HERE}.KwargsMLP", f"data.target={HERE}.dict_digits"],
], ids=["dict-batch-model-loss-metric", "tuple-batch-bare-loss", "dict-batch-loss-fn"])
def test_same_training_written_another_way(tmp_path, reference, overrides):
    ref_metrics, ref_params = reference
    metrics, params = run(tmp_path, "other", *overrides)
    for ours, theirs in zip(params, ref_params):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    for ours, theirs in zip(metrics, ref_metrics):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-12)
        assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=1e-12)
    if "trainer.eval_metric" in overrides[-1]:
        assert "accuracy" not in metrics[-1]  # the metric function replaces the built-in accuracy
        assert metrics[-1]["top1"] == pytest.approx(ref_metrics[-1]["accuracy"], abs=1e-12)
        assert metrics[-1]["one"] == 1.0  # a batch-size-weighted mean of the batch values
    elif "loss.target=null" in overrides:
        assert "accuracy" not in metrics[-1]  # a bare loss: nothing to score
    else:
        assert metrics[-1]["accuracy"] == ref_metrics[-1]["accuracy"] > 0.5  # chance: 0.1


def test_problems_are_one_line():
    model = KwargsMLP(hidden=8)
    x, y = torch.zeros(4, 64), torch.zeros(4, dtype=torch.long)
    with pytest.raises(DdpxError, match="a dict batch needs a 'labels' entry .* it has pixels, target"):
        model_loss(model, torch.nn.CrossEntropyLoss(), {"pixels": x, "target": y})
    with pytest.raises(DdpxError, match="loss.target is null, so the model must return its loss .* returned tuple"):
        model_loss(lambda x: (x, x), None, x)
    assert batch_size({"a": {"b": x[:3]}}) == 3 and batch_size((x, y), y[:2]) == 2
    with pytest.raises(DdpxError, match="trainer.eval_metric 'tests.test_batches.nope' does not resolve"):
        load_config(None, [f"trainer.eval_metric={HERE}.nope"], plugin_manager=make_plugin_manager(None, builtins=False, entry_points=False))

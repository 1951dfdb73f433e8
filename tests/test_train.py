"""The trainer loop against a hand-written one, and the default `ddpx train` run end to end."""

import json

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ddpx.config import load_config
from ddpx.data import digits_split
from ddpx.models import DigitsMLP
from ddpx.plugin.manager import make_plugin_manager
from ddpx.train.trainer import Trainer


def test_core_loop_matches_a_handwritten_loop(make_config, tmp_path):
    overrides = [
        "trainer.epochs=3",
        "trainer.batch_size=32",
        "trainer.grad_clip=1.0",
        "data.args.test_fraction=0.5",
        "model.args.hidden=32",
        "optimizer.args={lr: 0.1, momentum: 0.9}",
        "scheduler.target=torch.optim.lr_scheduler.StepLR",
        "scheduler.args={step_size: 30, gamma: 0.5}",
    ]
    trainer = Trainer(make_config(*overrides, defaults_only=True))
    metrics = trainer.run()
    assert not dist.is_initialized()

    # The same work by hand: seed, model, seeded shuffle, clip, step, scheduler per step.
    torch.manual_seed(0)
    model = DigitsMLP(hidden=32)
    train_set, test_set = digits_split(test_fraction=0.5, seed=0)
    loader = DataLoader(train_set, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.5)
    loss_fn = torch.nn.CrossEntropyLoss()
    steps = 0
    for _ in range(3):
        losses = []
        for x, y in loader:
            loss = loss_fn(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            losses.append(loss.item())
            steps += 1
    for ours, reference in zip(trainer.module.parameters(), model.parameters()):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    assert trainer.global_step == steps == 3 * len(loader)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(optimizer.param_groups[0]["lr"])
    assert metrics[-1]["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)

    with torch.no_grad():
        x, y = test_set.tensors
        logits = model(x)
        accuracy = (logits.argmax(1) == y).sum().item() / len(y)
        eval_loss = loss_fn(logits, y).item()
    assert metrics[-1]["accuracy"] == pytest.approx(accuracy, abs=1e-12) and accuracy > 0.6  # it learned
    assert metrics[-1]["eval_loss"] == pytest.approx(eval_loss, rel=1e-5)
    assert [m["epoch"] for m in metrics] == [0, 1, 2] and metrics[-1]["step"] == steps


def test_max_steps_and_eval_every(make_config, tmp_path):
    config = make_config("trainer.epochs=5", "trainer.max_steps=50", "trainer.eval_every_epochs=3", defaults_only=True)
    metrics = Trainer(config).run()
    # 45 steps per epoch: epoch 0 has no eval (every 3rd), epoch 1 stops at step 50 and evaluates (last).
    assert [(m["epoch"], m["step"], "accuracy" in m) for m in metrics] == [(0, 45, False), (1, 50, True)]


@pytest.mark.slow
def test_default_run_converges(ranks, tmp_path):
    rc, out, err = ranks.cli(["train", f"run_dir={tmp_path}/run"], timeout=180, cwd=tmp_path)
    assert rc == 0, err[-3000:]
    assert "Traceback" not in err
    assert "epoch 0" in err  # the rank-0 progress bar
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    epochs = [line for line in lines if line.get("kind") == "epoch"]
    assert [line["epoch"] for line in epochs] == list(range(10))
    # 1438 training samples over 2 ranks x 32 per batch: 23 optimizer steps per epoch.
    assert [line["step"] for line in epochs] == [23 * (e + 1) for e in range(10)]
    assert epochs[-1]["accuracy"] > 0.9
    assert epochs[-1]["loss"] < epochs[0]["loss"]
    assert all(line["loss"] > 0 for line in lines)


@pytest.mark.parametrize(
    "overrides, bucket_mb",
    [
        ([], 25),  # DDP's default
        (["comm_hook.name=fp16"], 25),  # no preference
        (["comm_hook.name=int8"], 4),  # the hook's preferred size
        (["comm_hook.name=int8", "trainer.bucket_cap_mb=8.0"], 8),  # the config wins
        (["comm_hook.name=int8", "trainer.gradient_as_bucket_view=false"], 4),
    ],
)
def test_ddp_options_from_the_comm_hook_unless_the_config_sets_them(tmp_path, overrides, bucket_mb):
    from ddpx import hookimpl
    from ddpx_plugins.comm_hook import CommHookPlugin

    seen = {}

    class Recorder:
        @hookimpl
        def ddpx_train_start(self, trainer):
            seen["bytes"] = trainer.model.bucket_bytes_cap
            seen["views"] = trainer.model.gradient_as_bucket_view
            seen["hook"] = type(trainer.plugin("comm_hook").state).__name__

    pm = make_plugin_manager(None, builtins=False, entry_points=False)
    pm.register(CommHookPlugin(), name="comm_hook")
    pm.register(Recorder(), name="recorder")
    config = load_config(None, [f"run_dir={tmp_path}/run", "trainer.max_steps=1", "trainer.eval_every_epochs=0",
                                *overrides], plugin_manager=pm)
    Trainer(config).run()
    assert seen["bytes"] == bucket_mb * 2**20
    # every ddpx hook asks for .grad as bucket views, unless the config says no
    assert seen["views"] == (bool(overrides) and "trainer.gradient_as_bucket_view=false" not in overrides)
    assert seen["hook"] == ("NoneType" if not overrides else "Fp16State" if "fp16" in overrides[0] else "Int8State")


def test_numpy_is_a_runtime_requirement():
    """Every run starts with all_gather_object, which torch 2.13 runs through numpy; the
    test extras bring numpy too, so only the declaration shows that a bare install works."""
    import importlib.metadata
    import re

    requirements = importlib.metadata.requires("ddpx")
    assert any(re.match(r"numpy\b", r) and "extra ==" not in r for r in requirements), requirements

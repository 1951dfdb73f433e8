"""``trainer.compile``: torch.compile of the DDP model gives the eager run's
training with every comm hook (Python and native), AMP and accumulation, and
refuses what it cannot do with one line."""

import pytest
import torch

from ddpx.config import load_config
from ddpx.errors import DdpxError
from ddpx.models import DigitsMLP
from ddpx.trainer import Trainer, compile_model

HOOKS = [("allreduce", True), ("fp16", True), ("fp16", False), ("bf16", True), ("int8", True), ("int8", False),
         ("onebit", True), ("powersgd", False)]
COMMON = ["trainer.epochs=1", "trainer.max_steps=4", "trainer.batch_size=64", "model.args.hidden=32",
          "amp.enabled=true", "amp.dtype=bf16", "accumulation.steps=2", "logging.progress=false",
          "checkpoint.enabled=false", "comm_monitor.enabled=false", "trainer.eval_every_epochs=0"]


def train(tmp_path, *overrides):
    trainer = Trainer(load_config(None, [*COMMON, f"run_dir={tmp_path}/run", *overrides]))
    metrics = trainer.run()
    return metrics[-1]["loss"], [p.detach().clone() for p in trainer.module.parameters()], trainer


@pytest.mark.parametrize("name,native", HOOKS)
def test_compiled_training_matches_eager(tmp_path, monkeypatch, name, native):
    hook = [f"comm_hook.name={name}", f"comm_hook.native={str(native).lower()}"]
    eager_loss, eager_params, _ = train(tmp_path, *hook)
    compiled = []
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compiled.append((type(model).__name__, kw))
                        or real_compile(model, **kw))
    # aot_eager: dynamo, the DDP graph split and AOTAutograd, without inductor's C++ build
    loss, params, _ = train(tmp_path, *hook, "trainer.compile=aot_eager")
    assert compiled == [("DistributedDataParallel", {"backend": "aot_eager"})]  # torch's DDP-aware path
    assert loss == pytest.approx(eager_loss, rel=1e-3)
    for ours, reference in zip(params, eager_params):
        torch.testing.assert_close(ours, reference, rtol=1e-3, atol=1e-4)
    torch.manual_seed(0)  # the trainer's initial weights
    initial = list(DigitsMLP(hidden=32).parameters())
    assert all((p != q).any() for p, q in zip(params, initial))  # it trained


@pytest.mark.slow
def test_inductor_compiles_on_cpu(tmp_path):
    """inductor with the machine's C++ compiler: the eager loss, within bf16 noise."""
    eager_loss, eager_params, _ = train(tmp_path, "comm_hook.name=powersgd")
    loss, params, _ = train(tmp_path, "comm_hook.name=powersgd", "trainer.compile=true")
    assert loss == pytest.approx(eager_loss, rel=2e-2)
    for ours, reference in zip(params, eager_params):
        torch.testing.assert_close(ours, reference, rtol=5e-2, atol=5e-3)


def test_compile_refusals_are_one_line(monkeypatch):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(DdpxError, match="trainer.compile: unknown backend 'nope'"):
        compile_model(model, "nope", torch.device("cpu"))
    monkeypatch.setenv("CXX", "")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(DdpxError, match="inductor on CPU needs a C\\+\\+ compiler"):
        compile_model(model, True, torch.device("cpu"))
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    with pytest.raises(DdpxError, match="torch.compile does not support Python"):
        compile_model(model, True, torch.device("cpu"))

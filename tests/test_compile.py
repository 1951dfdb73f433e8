"""``trainer.compile``: torch.compile of the DDP model gives the eager run's
training with every comm hook (Python and native), AMP and accumulation, and
refuses what it cannot do with one line."""

import pytest
import torch

from ddpx.config import load_config
from ddpx.errors import DdpxError
from ddpx.models import DigitsMLP
from ddpx.train.compile import compile_model
from ddpx.train.trainer import Trainer

HOOKS = [("allreduce", True), ("fp16", True), ("fp16", False), ("bf16", True), ("int8", True), ("int8", False),
         ("onebit", True), ("powersgd", False)]
COMMON = ["trainer.epochs=1", "trainer.max_steps=4", "trainer.batch_size=64", "model.args.hidden=32",
          "amp.enabled=true", "amp.dtype=bf16", "accumulation.steps=2", "logging.progress=false",
          "checkpoint.enabled=false", "comm_monitor.enabled=false", "trainer.eval_every_epochs=0"]


def train(tmp_path, *overrides, common=COMMON):
    torch._dynamo.reset()  # each run compiles afresh: no cache (or cache limit) left by an earlier test
    trainer = Trainer(load_config(None, [*common, f"run_dir={tmp_path}/run", *overrides]))
    metrics = trainer.run()
    # on the CPU: the trainer may have trained on a GPU, the references below are CPU tensors
    return metrics[-1]["loss"], [p.detach().cpu().clone() for p in trainer.module.parameters()], trainer


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
    assert compiled == [("DistributedDataParallel", {"backend": "aot_eager", "dynamic": None})]  # torch's DDP-aware path
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


# digits: 1438 training samples, batches of 64 -> 22 full batches and a short one of 30 per epoch
SHORT_LAST_BATCH = ["trainer.batch_size=64", "model.args.hidden=32", "logging.progress=false",
                    "checkpoint.enabled=false", "comm_monitor.enabled=false", "trainer.eval_every_epochs=0"]


GRAPHS = []  # what ddpx_test_counting compiled


def ddpx_test_counting(gm, example_inputs):
    """A torch.compile backend that runs the graphs eagerly and records, per graph,
    whether a size is symbolic (a SymInt input) and the leading sizes of its tensor inputs."""
    values = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    GRAPHS.append({"symbolic": any(isinstance(v, torch.SymInt) for v in values),
                   "sizes": [t.shape[0] for t in example_inputs if isinstance(t, torch.Tensor) and t.dim() > 0]})
    return gm.forward


@pytest.fixture
def counting_backend():
    """``trainer.compile=ddpx_test_counting``; yields the list of graphs it compiles."""
    if "ddpx_test_counting" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(ddpx_test_counting)
    GRAPHS.clear()
    yield GRAPHS


@pytest.mark.parametrize("hook", ["allreduce", pytest.param("int8", marks=pytest.mark.slow)])
def test_short_last_batch_compiles_no_second_graph(tmp_path, counting_backend, hook):
    """The default trainer.compile_dynamic=batch: every graph is compiled in the first
    step, with a symbolic batch size; three epochs, each ending with a short batch, add none."""
    hook_keys = [f"comm_hook.name={hook}", "comm_hook.options={warmup_steps: 0}"] if hook != "allreduce" else []
    train(tmp_path, "trainer.compile=ddpx_test_counting", "trainer.max_steps=1", *hook_keys, common=SHORT_LAST_BATCH)
    first_step = list(counting_backend)
    assert any(g["symbolic"] for g in first_step), first_step  # a symbolic batch size
    counting_backend.clear()
    train(tmp_path, "trainer.compile=ddpx_test_counting", "trainer.epochs=3", *hook_keys, common=SHORT_LAST_BATCH)
    assert len(counting_backend) == len(first_step)  # no recompile: not at the short batch, not in a later epoch


@pytest.mark.slow  # four epochs twice: torch's own behaviour, documented
@pytest.mark.parametrize("dynamic", ["auto", "static"])
def test_other_dynamic_choices_recompile_once_for_the_short_batch(tmp_path, counting_backend, dynamic):
    """torch's own choices: the short batch compiles once more in the first epoch, never in later ones."""
    keys = ["trainer.compile=ddpx_test_counting", f"trainer.compile_dynamic={dynamic}"]
    train(tmp_path, *keys, "trainer.epochs=1", common=SHORT_LAST_BATCH)
    one_epoch = list(counting_backend)
    assert not one_epoch[0]["symbolic"]  # first static, then compiled again for the short batch:
    assert any((30 in g["sizes"]) if dynamic == "static" else g["symbolic"] for g in one_epoch[1:]), one_epoch
    counting_backend.clear()
    train(tmp_path, *keys, "trainer.epochs=3", common=SHORT_LAST_BATCH)
    assert len(counting_backend) == len(one_epoch)


def test_compile_dynamic_is_checked():
    with pytest.raises(DdpxError, match="trainer.compile_dynamic' must be one of batch, auto, static, all"):
        load_config(None, ["trainer.compile_dynamic=sometimes"])

"""The built-in plugins through the real trainer: 2 ranks on gloo, each `python -m ddpx.worker`.

The workers join a TCPStore this test process serves (what torchrun's agent
would serve), so a run costs two interpreter start-ups and no launcher. This
module is also a plugin (``plugins.enable: [tests.test_builtin_plugins]``): the
recorder hooks below save what each rank saw to ``<run_dir>/record<rank>.pt``.
"""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch
import torch.distributed as dist
import yaml

from ddpx import hookimpl
from ddpx.net import free_port
from ddpx.data import digits_split

WORLD = 2


# --- data and the recorder plugin (imported by the workers) -------------------------------


def indexed_digits(num_train=None):
    """The digits split, each training sample carrying its index as a third tensor."""
    train, test = digits_split()
    x, y = train.tensors
    if num_train is not None:
        x, y = x[:num_train], y[:num_train]
    return torch.utils.data.TensorDataset(x, y, torch.arange(len(y))), test


def _counting_allreduce(state, bucket):
    state["allreduce_calls"] += 1
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


@hookimpl
def ddpx_config_defaults():
    return {"recorder": {"inf_at_step": -1}}


@hookimpl
def ddpx_model_wrapped(trainer, model):
    rec = trainer.recorder = {
        "allreduce_calls": 0,
        "indices": {},
        "batches": [],
        "metrics": [],
        "output_dtypes": set(),
    }
    if trainer.config.section("comm_hook")["name"] == "allreduce":  # a DDP model takes one hook
        model.register_comm_hook(rec, _counting_allreduce)
    trainer.module.register_forward_hook(
        lambda m, i, out: rec["output_dtypes"].add(str(out.dtype)) if m.training else None
    )


@hookimpl
def ddpx_train_start(trainer):
    trainer.recorder["init"] = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    trainer.log.info("recorder info from rank %d", trainer.rank)
    trainer.log.warning("recorder warning from rank %d", trainer.rank)


@hookimpl(wrapper=True)
def ddpx_forward(trainer, batch):
    trainer.recorder["indices"].setdefault(trainer.epoch, []).append(batch[2].tolist())
    loss = yield
    if trainer.global_step == trainer.config.section("recorder")["inf_at_step"] and trainer.rank == 0:
        loss = loss * math.inf  # an overflow on one rank: every rank must skip the step
    return loss


@hookimpl
def ddpx_batch_end(trainer, batch_index, loss, stepped):
    first = next(trainer.module.parameters())
    trainer.recorder["batches"].append(
        {"step": trainer.global_step, "stepped": stepped, "param_sum": first.detach().double().sum().item()}
    )


@hookimpl
def ddpx_epoch_end(trainer, epoch, metrics):
    trainer.recorder["metrics"].append(dict(metrics))


@hookimpl
def ddpx_train_end(trainer):
    rec = trainer.recorder
    rec["final"] = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    rec["global_step"] = trainer.global_step
    rec["scheduler_steps"] = None if trainer.scheduler is None else trainer.scheduler.last_epoch
    rec["lr"] = trainer.optimizer.param_groups[0]["lr"]
    rec["comm_hook"] = type(trainer.plugin("comm_hook").state).__name__
    rec["state_keys"] = sorted(trainer.state_dict())
    torch.save(rec, os.path.join(trainer.run_dir, f"record{trainer.rank}.pt"))


# --- running 2 ranks -----------------------------------------------------------------------


def run_ranks(ranks, tmp_path, config, timeout=120, agent_store=True):
    """Train ``config`` on WORLD gloo ranks with this module as a plugin recording every
    rank; return (records, output per rank, run_dir). ``agent_store``: see ``ranks.train``."""
    run_dir = tmp_path / "run"
    config = dict(config, run_dir=str(run_dir))
    config.setdefault("plugins", {})["enable"] = ["tests.test_builtin_plugins"]
    config.setdefault("checkpoint", {})["enabled"] = False
    config.setdefault("trainer", {}).update(backend="gloo", device="cpu")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    outputs = ranks.train(run_dir, path, WORLD, timeout, agent_store=agent_store)
    records = [torch.load(run_dir / f"record{rank}.pt", weights_only=False) for rank in range(WORLD)]
    return records, outputs, run_dir


def test_ranks_started_without_torchrun_rendezvous_through_rank_0(ranks, tmp_path):
    """srun, mpirun or a script set RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT and start
    the workers themselves: nobody else serves the store, so rank 0 must (it used to wait
    as a client for trainer.first_timeout_s, 15 minutes by default, and every rank with it)."""
    config = {
        "model": {"target": "ddpx.models.DigitsMLP", "args": {"hidden": 32}},
        "data": {"target": "tests.test_builtin_plugins.indexed_digits", "args": {}},
        "trainer": {"epochs": 2, "batch_size": 32},
        "logging": {"progress": False},
    }
    records, _, _ = run_ranks(ranks, tmp_path, config, timeout=60, agent_store=False)
    assert [rec["global_step"] for rec in records] == [records[0]["global_step"]] * WORLD
    assert records[0]["global_step"] > 0 and records[0]["metrics"][-1]["accuracy"] > 0.5  # it trains (chance: 0.1)


def test_rendezvous_store_failures_are_one_line(capfd):
    import datetime
    import socket

    import harness  # here: the workers import this module as a plugin, without tests/ on their path

    from ddpx.rank import process_group
    from ddpx.errors import DdpxError

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(DdpxError, match=f"rank 0 cannot serve the rendezvous store on MASTER_PORT={port} "
                                            r"\(.*address already in use.*\); set MASTER_PORT to a free port"):
            process_group.tcp_store("127.0.0.1", port, 0, serve=True, timeout=datetime.timedelta(seconds=2))
    start = harness.clock()
    with pytest.raises(DdpxError, match=r"rank 1: no rendezvous store answered at MASTER_ADDR=127.0.0.1 "
                                        r"MASTER_PORT=\d+ within 1 s .*trainer.first_timeout_s"):
        process_group.tcp_store("127.0.0.1", free_port(), 1, serve=False, timeout=datetime.timedelta(seconds=1))
    assert harness.clock() - start < 30  # bounded by the timeout, not a hang
    err = capfd.readouterr().err
    assert "frame #" not in err and "Exception raised from" not in err  # no C++ stack traces around the line


def epoch_order(num_samples, seed, epoch):
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


# --- accumulation ---------------------------------------------------------------------------


def test_step_windows_and_short_final_window():
    from types import SimpleNamespace

    from ddpx.plugin.shared import ACCUMULATION_STEPS, Shared
    from ddpx_plugins.accumulation import AccumulationPlugin

    plugin = AccumulationPlugin()
    trainer = SimpleNamespace(config=SimpleNamespace(section=lambda name: {"steps": 4}), shared=Shared())
    plugin.ddpx_setup(trainer=trainer)
    assert trainer.shared[ACCUMULATION_STEPS] == 4  # what the checkpoint and comm monitor plugins read
    windows, index = [], 0
    while index < 10:
        windows.append(plugin.ddpx_step_window(trainer=None, batch_index=index, num_batches=10))
        index += windows[-1]
    assert windows == [4, 4, 2]  # steps after micro-batches 4, 8 and 10


def test_accumulation_equals_one_big_batch(ranks, tmp_path):
    """40 samples, 2 ranks x 4 per micro-batch = 5 micro-batches per epoch, 2 per step:
    windows of 2, 2 and a short final 1. Parameters must match plain SGD on the
    windows' samples taken as one batch each; DDP must all-reduce once per window."""
    n, batch, accumulate, epochs, lr, gamma, seed = 40, 4, 2, 2, 0.5, 0.8, 3
    config = {
        "seed": seed,
        "model": {"target": "torch.nn.Linear", "args": {"in_features": 64, "out_features": 10}},
        "data": {"target": "tests.test_builtin_plugins.indexed_digits", "args": {"num_train": n}},
        "optimizer": {"target": "torch.optim.SGD", "args": {"lr": lr}},
        "scheduler": {"target": "torch.optim.lr_scheduler.ExponentialLR", "args": {"gamma": gamma}},
        "trainer": {"epochs": epochs, "batch_size": batch},
        "accumulation": {"steps": accumulate},
        "logging": {"every_steps": 1, "all_ranks": True, "progress": False},
    }
    records, errors, _ = run_ranks(ranks, tmp_path, config)
    r0, r1 = records

    # the reference: one process, each window's samples as one batch
    train, _ = indexed_digits(n)
    x, y, _ = train.tensors
    model = torch.nn.Linear(64, 10)
    model.load_state_dict(r0["init"])
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma)
    loss_fn = torch.nn.CrossEntropyLoss()
    per_step = WORLD * batch
    ref_epoch_losses = []
    for epoch in range(epochs):
        order = epoch_order(n, seed, epoch)
        micro_losses = []
        for start in range(0, n, per_step * accumulate):
            window = order[start : start + per_step * accumulate]
            with torch.no_grad():  # the unscaled per-rank micro-batch losses the trainer reports
                for i in range(0, len(window), batch):
                    micro = window[i : i + batch]
                    micro_losses.append(loss_fn(model(x[micro]), y[micro]).item())
            optimizer.zero_grad()
            loss_fn(model(x[window]), y[window]).backward()
            optimizer.step()
            scheduler.step()
        ref_epoch_losses.append(sum(micro_losses) / len(micro_losses))
        # every rank saw its slice of every global micro-batch, in order
        for rank, rec in enumerate(records):
            expected = [order[g + rank * batch : g + (rank + 1) * batch] for g in range(0, n, per_step)]
            assert rec["indices"][epoch] == expected

    for rec in records:
        for key, value in model.state_dict().items():
            torch.testing.assert_close(rec["final"][key], value, rtol=1e-5, atol=1e-6)
        assert rec["global_step"] == epochs * 3  # 5 micro-batches -> windows 2, 2, 1
        assert rec["scheduler_steps"] == epochs * 3  # the scheduler follows optimizer steps
        assert rec["lr"] == pytest.approx(lr * gamma ** (epochs * 3))
        assert rec["allreduce_calls"] == epochs * 3  # no_sync on the other micro-batches (1 bucket)
        assert [b["stepped"] for b in rec["batches"]] == [False, True, False, True, True] * epochs
    for got, want in zip(r0["metrics"], ref_epoch_losses):
        assert got["loss"] == pytest.approx(want, rel=1e-5)  # the reported loss is unscaled
    # logging.all_ranks: every rank's info messages, with its prefix
    assert "[rank0] recorder info from rank 0" in errors[0]
    assert "[rank1] recorder info from rank 1" in errors[1]


def test_unknown_comm_hook_name_lists_the_choices():
    from types import SimpleNamespace

    from ddpx.errors import DdpxError
    from ddpx_plugins.comm_hook import CommHookPlugin

    pytest.importorskip("ddpx.comm_hooks")
    sgd = SimpleNamespace(target="torch.optim.SGD")  # an optimizer that needs no hook of its own
    ddp = SimpleNamespace(strategy="ddp")
    config = SimpleNamespace(section=lambda name: {"name": "int7", "native": True, "options": {}}, optimizer=sgd,
                             trainer=ddp)
    with pytest.raises(DdpxError, match="unknown comm_hook.name 'int7'; choose one of: allreduce, bf16, .*int8"):
        CommHookPlugin().ddpx_configure(config=config)
    config = SimpleNamespace(section=lambda name: {"name": "int8", "native": True, "options": {"blok": 3}}, optimizer=sgd,
                             trainer=ddp)
    with pytest.raises(DdpxError, match="unknown option.*blok"):
        CommHookPlugin().ddpx_configure(config=config)


# --- amp --------------------------------------------------------------------------------------


def _amp_trainer(grad_clip=None, init_scale=1024.0):
    """A stand-in trainer with what the AMP plugin and the trainer's optimizer step read, on CPU."""
    from types import SimpleNamespace

    from ddpx_plugins.amp import AmpPlugin

    model = torch.nn.Linear(4, 3)
    sections = {"amp": {"enabled": True, "dtype": "fp16", "init_scale": init_scale}}
    trainer = SimpleNamespace(
        config=SimpleNamespace(section=sections.__getitem__),
        device=torch.device("cpu"),
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        norms_seen=[],
        global_step=0,
        epoch=0,
        plugin=AmpPlugin(),
    )

    def clip_gradients():
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))
        trainer.norms_seen.append(norm.item())

    trainer.clip_gradients = clip_gradients
    trainer.plugin.ddpx_setup(trainer=trainer)
    trainer.scaler = trainer.plugin.ddpx_grad_scaler(trainer=trainer)
    return trainer


def test_amp_unscales_before_clipping_and_restores_the_scaler():
    from ddpx.train.default_hooks import DefaultHooks

    trainer = _amp_trainer(grad_clip=0.5)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    loss = torch.nn.functional.cross_entropy(trainer.module(x), y)
    reference = torch.autograd.grad(loss, list(trainer.module.parameters()), retain_graph=True)
    true_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in reference])).item()
    trainer.scaler.scale(loss).backward()  # what Trainer.backward does
    assert trainer.module.weight.grad.abs().max() > 100 * reference[0].abs().max()  # scaled by 1024
    defaults = DefaultHooks()
    assert defaults.ddpx_optimizer_step(trainer=trainer) is True
    assert trainer.norms_seen == [pytest.approx(true_norm, rel=1e-5)]  # clipping saw the true gradients

    trainer.module.weight.grad = torch.full_like(trainer.module.weight, math.inf)
    before = trainer.module.weight.detach().clone()
    assert defaults.ddpx_optimizer_step(trainer=trainer) is False
    assert torch.equal(trainer.module.weight, before)
    assert trainer.scaler.get_scale() == 512.0

    state = trainer.plugin.state_dict(trainer)
    fresh = _amp_trainer(init_scale=65536.0)
    fresh.plugin.load_state_dict(fresh, state)
    assert fresh.scaler.get_scale() == 512.0
    assert fresh.scaler.state_dict() == trainer.scaler.state_dict()


def test_fp16_overflow_skips_the_step_on_every_rank(ranks, tmp_path):
    inf_at = 3
    config = {
        "model": {"target": "ddpx.models.DigitsMLP", "args": {"hidden": 32}},
        "data": {"target": "tests.test_builtin_plugins.indexed_digits", "args": {}},
        "optimizer": {"target": "torch.optim.SGD", "args": {"lr": 0.1, "momentum": 0.9}},
        "scheduler": {"target": "torch.optim.lr_scheduler.StepLR", "args": {"step_size": 1, "gamma": 1.0}},
        "trainer": {"epochs": 6, "batch_size": 32, "grad_clip": 1.0},
        "amp": {"enabled": True, "dtype": "fp16", "init_scale": 1024.0},
        "recorder": {"inf_at_step": inf_at},
        "logging": {"progress": False},
    }
    records, _, _ = run_ranks(ranks, tmp_path, config)
    for rec in records:
        assert rec["output_dtypes"] == {"torch.float16"}  # the forward ran under fp16 autocast
        batches = rec["batches"]
        assert [b["stepped"] for b in batches].count(False) == 1
        skipped = next(i for i, b in enumerate(batches) if not b["stepped"])
        assert batches[skipped]["step"] == inf_at + 1  # the step counter moves on
        assert batches[skipped]["param_sum"] == batches[skipped - 1]["param_sum"]  # weights untouched
        assert batches[skipped + 1]["param_sum"] != batches[skipped]["param_sum"]  # training resumed
        assert rec["scheduler_steps"] == rec["global_step"] - 1  # no scheduler step for the skipped one
        last = rec["metrics"][-1]
        assert last["amp_skipped_steps"] == 1
        assert last["amp_scale"] == 512.0  # halved once, never grown (growth interval 2000)
        assert last["accuracy"] > 0.9
        assert math.isinf(rec["metrics"][0]["loss"])  # the injected inf is in epoch 0's mean
    torch.testing.assert_close(records[0]["final"], records[1]["final"], rtol=0, atol=0)


def test_bf16_runs_and_converges_with_sampler_and_metrics(ranks, tmp_path):
    """bf16 autocast; the sampler's per-epoch shuffle (identical across ranks,
    different per epoch, disjoint shards covering the epoch) and exact sharded
    evaluation; the fp16 comm hook; metrics.jsonl; rank-0-only info logging."""
    epochs, seed, batch, every = 6, 5, 32, 7
    config = {
        "seed": seed,
        "model": {"target": "ddpx.models.DigitsMLP", "args": {"hidden": 64}},
        "data": {"target": "tests.test_builtin_plugins.indexed_digits", "args": {}},
        "optimizer": {"target": "torch.optim.SGD", "args": {"lr": 0.1, "momentum": 0.9}},
        "trainer": {"epochs": epochs, "batch_size": batch},
        "amp": {"enabled": True, "dtype": "bf16"},
        "logging": {"every_steps": every, "progress": True},
        "comm_hook": {"name": "fp16"},
    }
    records, errors, run_dir = run_ranks(ranks, tmp_path, config)
    train, test = indexed_digits()
    n = len(train)
    orders = []
    for epoch in range(epochs):
        order = epoch_order(n, seed, epoch)
        orders.append(order)
        shards = [[i for b in rec["indices"][epoch] for i in b] for rec in records]
        assert not set(shards[0]) & set(shards[1])
        assert sorted(shards[0] + shards[1]) == list(range(n))
        steps = list(zip(records[0]["indices"][epoch], records[1]["indices"][epoch]))
        assert [i for a, b in steps for i in a + b] == order  # global batches follow the epoch order
    assert len({tuple(order) for order in orders}) == epochs

    for rec in records:
        assert rec["output_dtypes"] == {"torch.bfloat16"}
        assert all(b["stepped"] for b in rec["batches"])
        assert "amp_skipped_steps" not in rec["metrics"][-1]  # bf16: no scaler
    assert records[0]["metrics"][-1]["accuracy"] > 0.9
    # evaluation sharded without padding: exactly the accuracy over the whole eval set
    from ddpx.models import DigitsMLP

    model = DigitsMLP(hidden=64)
    model.load_state_dict(records[0]["final"])
    with torch.no_grad():
        correct = (model(test.tensors[0]).argmax(1) == test.tensors[1]).sum().item()
    assert len(test) % WORLD == 1  # padding would have counted one sample twice
    assert records[0]["metrics"][-1]["accuracy"] == pytest.approx(correct / len(test), abs=1e-12)
    for rec in records:
        assert rec["comm_hook"] not in ("NoneType", None)
        assert {"sampler", "comm_hook", "model", "optimizer"} <= set(rec["state_keys"])
        assert "amp" not in rec["state_keys"]  # bf16: no scaler state
    torch.testing.assert_close(records[0]["final"], records[1]["final"], rtol=0, atol=0)

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_per_epoch = math.ceil(n / (WORLD * batch))
    step_lines = [line for line in lines if line["kind"] == "step"]
    epoch_lines = [line for line in lines if line["kind"] == "epoch"]
    assert [line["step"] for line in step_lines] == list(range(every, epochs * steps_per_epoch + 1, every))
    assert [line["epoch"] for line in step_lines] == [(s - 1) // steps_per_epoch for s in range(every, epochs * steps_per_epoch + 1, every)]
    assert all(0 < line["loss"] < 3 and line["samples_per_s"] > 0 for line in step_lines)
    assert [(line["epoch"], line["step"]) for line in epoch_lines] == [(e, (e + 1) * steps_per_epoch) for e in range(epochs)]
    for line, metrics in zip(epoch_lines, records[0]["metrics"]):
        assert line["loss"] == pytest.approx(metrics["loss"]) and line["accuracy"] == pytest.approx(metrics["accuracy"])
    assert step_lines[-1]["loss"] < step_lines[0]["loss"]

    # rank-aware logging: rank 0 info shown with its prefix, other ranks only warnings
    assert "[rank0] recorder info from rank 0" in errors[0]
    assert f"[rank0] epoch {epochs - 1} (step" in errors[0]
    assert "recorder info" not in errors[1]
    assert "[rank1] recorder warning from rank 1" in errors[1]
    assert "%|" not in errors[0] and "\r" not in errors[0]  # not a terminal: no bar redraws piling up in the log
    assert "%|" not in errors[1]  # no bar on other ranks
    # what the fp16 hook saved, once per epoch: 2 bytes per element of the two 64 x 64 matrices, 4 of the 64 x 10
    # one (under min_numel) and of the biases, against 4 of each in an fp32 allreduce (two ranks: as many bytes
    # sent as there are); and at install, what it compresses
    assert re.search(rf"\[rank0\] epoch {epochs - 1} \(step \d+\): .*; comm 19\.5 kB/step, 1\.84x less than fp32 "
                     r"allreduce \(35\.9 kB\)\n", errors[0]), errors[0]
    assert "; 2 of 6 parameters compressed (91.3% of the elements; min_numel=1024 leaves 1 small tensor in fp32; " \
           "3 vectors (biases, norms) in fp32, compress_vectors=false)\n" in errors[0], errors[0]


def test_a_run_ends_with_a_summary_and_its_bar_counts_to_max_steps(make_config, tmp_path, capsys, monkeypatch):
    """The default run ended without a summary, and with ``trainer.max_steps`` ending the run
    first the bar counted every epoch's batches (char GPT: 0/35700, 2-hour ETA, stuck at 0 %)."""
    from ddpx.train.trainer import Trainer

    monkeypatch.setattr("ddpx_plugins.logging.progress.on_terminal", lambda stream=None: True)

    run_dir = tmp_path / "run"
    config = make_config("trainer.epochs=50", "trainer.max_steps=5", "trainer.batch_size=128", "accumulation.steps=5",
                         "logging.progress=true", run_dir=run_dir)
    metrics = Trainer(config).run()
    err = capsys.readouterr().err
    bar = err.replace("\r", "\n")
    # 5 steps of 5 micro-batches first; at epoch 1's start, the 12 batches of epoch 0 (3 steps, the
    # last of 2 batches) plus 2 steps of 5: 22, all of them shown at the end (was 0/600: 12 x 50 epochs)
    assert "| 0/25 [" in bar and "100%|██████████| 22/22 [" in bar
    assert "/600 [" not in bar
    last = metrics[-1]
    shown = "  ".join(f"{k} {v:.4g}" for k, v in last.items() if k not in ("epoch", "step"))
    summary = err.strip().splitlines()[-1]
    assert re.fullmatch(rf"\[rank0\] finished after \d+\.\d s of training \(step 5\); epoch {last['epoch']}: "
                        rf"{re.escape(shown)}; run directory {re.escape(str(run_dir))}", summary), summary


def test_progress_bar_loss_follows_training(capsys, monkeypatch):
    """The bar shows the mean loss since its previous redraw, not the last step line's."""
    from ddpx.train.losses import EpochLosses
    from ddpx_plugins.logging.metrics_log import MetricsLog

    monkeypatch.setattr("ddpx_plugins.logging.progress.on_terminal", lambda stream=None: True)
    losses = EpochLosses()  # what the trainer keeps
    log = MetricsLog(every_steps=50, progress=True, samples_per_batch=32)
    log.window, log.bar_window = losses.open_window(), losses.open_window()
    log.start_bar(0, 10, print)
    losses.append(torch.tensor(2.0))
    losses.append(torch.tensor(4.0))
    log.advance_bar()
    assert log.bar.n == 2 and log.bar.postfix == "loss=3.0000"
    losses.append(torch.tensor(0.5))
    log.advance_bar()
    assert log.bar.n == 3 and log.bar.postfix == "loss=0.5000"
    log.advance_bar()  # nothing new: the last loss stays
    assert log.bar.postfix == "loss=0.5000"
    log.close()


def test_the_bar_over_a_stream_counts_to_max_steps():
    """A loader without a length (a stream) gave the bar no total even with ``trainer.max_steps``."""
    from types import SimpleNamespace

    from ddpx_plugins.logging import ACCUMULATION_STEPS, batches_left

    def trainer(loader, max_steps, step=0):
        config = SimpleNamespace(trainer=SimpleNamespace(epochs=3, max_steps=max_steps))
        return SimpleNamespace(train_loader=loader, config=config, global_step=step,
                               shared={ACCUMULATION_STEPS: 2})

    stream = iter(())  # no __len__
    assert batches_left(trainer(stream, max_steps=None), epoch=0) is None
    assert batches_left(trainer(stream, max_steps=10, step=4), epoch=1) == 12  # 6 steps of 2 micro-batches
    from torch.utils.data import DataLoader, IterableDataset

    class Endless(IterableDataset):
        def __iter__(self):
            yield from range(3)

    loader = DataLoader(Endless())  # has __len__, which raises: a plugin's own loader over a stream
    assert batches_left(trainer(loader, max_steps=10, step=4), epoch=1) == 12
    assert batches_left(trainer(range(5), max_steps=10, step=4), epoch=1) == 10  # 2 epochs of 5 come first

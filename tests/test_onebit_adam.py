"""1-bit Adam (``ddpx.optim.OneBitAdam`` + the ``onebit_adam`` hook) on gloo, 2 ranks:
every step against a reference written in plain torch (fp64, both ranks simulated in one
process: exact AdamW during the warm-up, then local momentum, 1-bit compression with
worker and server error feedback, the frozen second moment); exact resume from a
checkpoint; a world-size change; GradScaler's skip agreed by every rank. Without
processes: the plain ``onebit`` hook warns once with an Adam-family optimizer, and the
``comm_hook`` plugin pairs the optimizer with its hook or says which key to fix.
"""

import copy
import logging
import types

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from comm_hook_checks import WarningRecords

import ddpx.comm_hooks
import ddpx.optim
from ddpx.comm_hooks import onebit
from ddpx.errors import DdpxError

ADAMW = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
HOOK = dict(warmup_steps=3, min_numel=256, chunk_size=8)  # both 16x32 matrices compressed
STEPS = 8


def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4)).to(dtype)


def batch(step, rank, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g).to(dtype), torch.randn(8, 4, generator=g).to(dtype)


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


class Run:
    """One rank's DDP model, hook and OneBitAdam."""

    def __init__(self, rank, hook=HOOK, bucket_cap_mb=25):
        self.rank = rank
        self.model = make_model()
        self.ddp = DDP(self.model, bucket_cap_mb=bucket_cap_mb)
        self.state = ddpx.comm_hooks.register(self.ddp, "onebit_adam", **hook)
        self.opt = ddpx.optim.OneBitAdam(self.ddp.parameters(), comm=self.state, **ADAMW)

    def step(self, step, scaler=None, clip=None):
        self.opt.zero_grad(set_to_none=True)
        x, y = batch(step, self.rank)
        loss = loss_of(self.ddp, x, y)
        if scaler is None:
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            self.opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(self.opt)
            scaler.update()

    def params(self):
        return [p.detach().clone() for p in self.model.parameters()]

    def snapshot(self):
        return {"model": {k: v.clone() for k, v in self.model.state_dict().items()},
                "opt": copy.deepcopy(self.opt.state_dict()), "hook": self.state.state_dict()}

    def restore(self, snap):
        self.model.load_state_dict(snap["model"])
        self.opt.load_state_dict(snap["opt"])
        self.state.load_state_dict(snap["hook"])


# ------------------------------------------------------------- the fp64 reference
def onebit_code(v, chunk):
    """Signs times each chunk's mean |v| (ddpx.ops's 1-bit format, v >= 0 -> +)."""
    c = v.view(-1, chunk)
    scale = c.abs().mean(dim=1, keepdim=True)
    return torch.where(c >= 0, scale, -scale).reshape(-1)


def reference(world=2, steps=STEPS):
    """Params after every step, in fp64: AdamW on the exact mean gradient for the warm-up,
    then 1-bit Adam: local momentum over the frozen denominator (the update), its
    compressed average with worker and server error, that update applied."""
    model = make_model(torch.float64)
    params = list(model.parameters())
    b1, b2 = ADAMW["betas"]
    lr, eps, wd, chunk = ADAMW["lr"], ADAMW["eps"], ADAMW["weight_decay"], HOOK["chunk_size"]
    compressed = [i for i, p in enumerate(params) if p.numel() >= HOOK["min_numel"] and p.dim() > 1]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    n = sum(params[i].numel() for i in compressed)
    seg = n // world  # whole chunks and 32-bit words here: the hook's segments
    worker_err = [torch.zeros(n, dtype=torch.float64) for _ in range(world)]
    server_err = torch.zeros(n, dtype=torch.float64)  # rank r's segment is rank r's memory
    out = []
    for step in range(steps):
        grads = []
        for rank in range(world):
            model.zero_grad()
            loss_of(model, *batch(step, rank, torch.float64)).backward()
            grads.append([p.grad.clone() for p in params])
        t = step + 1
        with torch.no_grad():
            if step < HOOK["warmup_steps"]:
                for i, p in enumerate(params):
                    g = sum(gr[i] for gr in grads) / world
                    m[i] = b1 * m[i] + (1 - b1) * g
                    v[i] = b2 * v[i] + (1 - b2) * g * g
                    p.mul_(1 - lr * wd)
                    p.sub_(lr / (1 - b1 ** t) * m[i] / ((v[i] / (1 - b2 ** t)).sqrt() + eps))
                    frozen = t
            else:
                denom = [(v[i] / (1 - b2 ** frozen)).sqrt() + eps for i in range(len(params))]
                # what travels: each rank's update, its local momentum over the frozen denominator
                bound = (1 - b1) / ((1 - b2) * (1 - b1 * b1 / b2)) ** 0.5  # exact Adam's largest |m / sqrt(v)|
                local = [[((b1 * m[i] + (1 - b1) * grads[r][i]) / denom[i]).clamp(-bound, bound)
                          for i in range(len(params))] for r in range(world)]
                update = [sum(local[r][i] for r in range(world)) / world for i in range(len(params))]  # exact
                # the hook packs the compressed parameters in descending key (= parameter) order
                order = compressed[::-1]
                sent = []
                for r in range(world):
                    x = torch.cat([local[r][i].reshape(-1) for i in order]) + worker_err[r]
                    sent.append(onebit_code(x, chunk))
                    worker_err[r] = x - sent[r]
                avg = sum(sent) / world + server_err
                result = torch.cat([onebit_code(avg[s * seg:(s + 1) * seg], chunk) for s in range(world)])
                server_err = avg - result
                off = 0
                for i in order:
                    k = params[i].numel()
                    update[i] = result[off:off + k].view_as(params[i]).clone()
                    off += k
                for i, p in enumerate(params):
                    m[i] = update[i] * denom[i]
                    p.mul_(1 - lr * wd)
                    p.sub_(lr / (1 - b1 ** t) * update[i])
        out.append([p.detach().float().clone() for p in params])
    return out


# ---------------------------------------------------------------- workers
def steps_worker(rank, world):
    run = Run(rank)
    out = []
    for step in range(STEPS):
        run.step(step)
        out.append(run.params())
    stats = run.state.stats()
    numel = sum(p.numel() for p in run.model.parameters())
    return {"params": out, "stats": stats, "numel": numel}


def resume_worker(rank, world):
    res = {}
    full = Run(rank)
    for step in range(5):
        full.step(step)
    snap = full.snapshot()  # compressing since step 3: error memory and frozen variance in it
    for step in range(5, 10):
        full.step(step)
    resumed = Run(rank)
    resumed.restore(snap)
    for step in range(5, 10):
        resumed.step(step)
    res["full"], res["resumed"] = full.params(), resumed.params()
    res["variance_step"] = {s["variance_step"] for s in snap["opt"]["state"].values()}
    # another world size: the error memory is reset with a warning, Adam's state is kept
    records = WarningRecords()
    logging.getLogger("ddpx.comm_hooks").addHandler(records)
    try:
        groups = [dist.new_group([r]) for r in range(world)]
        single = ddpx.comm_hooks.make_state("onebit_adam", process_group=groups[rank], **HOOK)
        single.load_state_dict(snap["hook"])
    finally:
        logging.getLogger("ddpx.comm_hooks").removeHandler(records)
    res["resize"] = {"warnings": records.messages, "steps": single.steps,
                     "memory": sum(float(t.abs().sum()) for d in single.memory.values() for t in d.values())}
    return res


def scaler_worker(rank, world):
    """fp16-style loss scaling: rank 1 alone overflows at step 5 (compressing); both skip it."""
    run = Run(rank)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scales = []
    for step in range(8):
        if step == 5 and rank == 1:
            with torch.no_grad():
                run.model[0].bias.grad = None
            x, y = batch(step, rank)
            run.opt.zero_grad(set_to_none=True)
            loss = loss_of(run.ddp, x, y) * float("inf")
            scaler.scale(loss).backward()
            scaler.step(run.opt)
            scaler.update()
        else:
            run.step(step, scaler=scaler)
        scales.append(scaler.get_scale())
    return {"params": run.params(), "scales": scales}


def two_ranks_worker(rank, world):
    """The three scenarios, one after the other in one launch (resume's groups last)."""
    return {"steps": steps_worker(rank, world), "scaler": scaler_worker(rank, world),
            "resume": resume_worker(rank, world)}


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def two_ranks(ranks):
    return ranks.call(two_ranks_worker, 2, timeout=240)


@pytest.fixture(scope="module")
def stepped(two_ranks):
    return [rank_out["steps"] for rank_out in two_ranks]


@pytest.fixture(scope="module")
def resumed(two_ranks):
    return [rank_out["resume"] for rank_out in two_ranks]


# ------------------------------------------------------------------- tests
def test_every_step_matches_the_fp64_reference(stepped):
    ref = reference()
    for rank_out in stepped:
        for step, (got, want) in enumerate(zip(rank_out["params"], ref)):
            for g, w in zip(got, want):
                assert torch.allclose(g, w, rtol=1e-4, atol=1e-6), f"step {step}: max error {(g - w).abs().max()}"
    for a, b in zip(stepped[0]["params"][-1], stepped[1]["params"][-1]):
        assert torch.equal(a, b)  # replicas bit-identical


def test_compressed_steps_send_no_gradient_and_a_sixteenth_of_fp32(stepped):
    stats, numel = stepped[0]["stats"], stepped[0]["numel"]
    fp32 = 4 * numel  # one rank's bytes per step in a 2-rank ring allreduce: 2 (R-1)/R x 4 bytes
    compressed_steps = STEPS - HOOK["warmup_steps"]
    compressed = (stats["wire_bytes"] - HOOK["warmup_steps"] * fp32) / compressed_steps
    # this toy model is a third biases and small matrices (exact): well under fp32, above 1/16
    assert compressed < fp32 / 2
    assert stats["steps"] == STEPS


def test_resume_continues_bit_identically(resumed):
    for rank_out in resumed:
        assert all(torch.equal(a, b) for a, b in zip(rank_out["resumed"], rank_out["full"]))
        assert rank_out["variance_step"] == {HOOK["warmup_steps"]}


def test_another_world_size_resets_the_error_memory_and_keeps_the_counters(resumed):
    info = resumed[0]["resize"]
    assert any("error-feedback memory is per rank and is reset" in w for w in info["warnings"])
    assert info["memory"] == 0 and info["steps"] == 5


def test_a_rank_that_overflows_alone_makes_every_rank_skip(two_ranks):
    out = [rank_out["scaler"] for rank_out in two_ranks]
    assert out[0]["scales"] == out[1]["scales"]
    assert out[0]["scales"][5] < out[0]["scales"][4]  # the overflow was seen by both
    assert all(torch.equal(a, b) for a, b in zip(out[0]["params"], out[1]["params"]))
    assert all(torch.isfinite(p).all() for p in out[0]["params"])


# ------------------------------------------------------------ without processes
def test_onebit_hook_paired_with_an_adam_family_optimizer_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(onebit, "_adam_warned", False)
    caplog.set_level(logging.WARNING, logger="ddpx.comm_hooks")
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))])
    for _ in range(2):
        state, _ = ddpx.comm_hooks.make("onebit")
        state.pair(opt)
    warnings = [r.getMessage() for r in caplog.records if "onebit_adam" in r.getMessage()]
    assert len(warnings) == 1 and "ddpx.optim.OneBitAdam" in warnings[0] and "AdamW" in warnings[0]


def test_onebit_hook_paired_with_sgd_does_not_warn(monkeypatch, caplog):
    monkeypatch.setattr(onebit, "_adam_warned", False)
    caplog.set_level(logging.WARNING, logger="ddpx.comm_hooks")
    state, _ = ddpx.comm_hooks.make("onebit")
    state.pair(torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1))
    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.ones(3)
    torch.optim.AdamW([w]).step()  # an optimizer stepping elsewhere in the process: none of the hook's business
    assert not [r for r in caplog.records if "onebit_adam" in r.getMessage()]


def test_without_its_hook_it_is_adamw():
    a, b = make_model(), make_model()
    opt_a, opt_b = ddpx.optim.OneBitAdam(a.parameters(), **ADAMW), torch.optim.AdamW(b.parameters(), **ADAMW)
    for step in range(3):
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            loss_of(model, *batch(step, 0)).backward()
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_bad_pairings_are_one_line_errors():
    with pytest.raises(DdpxError, match="comm must be the state of the 'onebit_adam' hook"):
        ddpx.optim.OneBitAdam(make_model().parameters(), comm=ddpx.comm_hooks.make_state("int8"))
    with pytest.raises(DdpxError, match=r"^comm hook 'onebit_adam' averages the gradients through its optimizer: "
                                        r"pair it with ddpx.optim.OneBitAdam, not AdamW$"):
        ddpx.comm_hooks.make_state("onebit_adam").pair(torch.optim.AdamW(make_model().parameters()))
    with pytest.raises(DdpxError, match="amsgrad=True is not supported"):
        ddpx.optim.OneBitAdam(make_model().parameters(), amsgrad=True)
    with pytest.raises(DdpxError, match="warmup_steps must be >= 1"):
        ddpx.comm_hooks.make("onebit_adam", warmup_steps=0)
    assert "onebit_adam" not in ddpx.comm_hooks.available()  # it does not average gradients alone
    assert "onebit_adam" in ddpx.comm_hooks.available(with_optimizer=True)


def _config(optimizer, hook):
    comm = {"name": hook, "options": {}, "native": True}
    return types.SimpleNamespace(section=lambda name: comm, optimizer=types.SimpleNamespace(target=optimizer))


def test_the_plugin_pairs_the_optimizer_with_its_hook():
    from ddpx_plugins.comm_hook import hook_name

    assert hook_name(_config("ddpx.optim.OneBitAdam", "allreduce")) == "onebit_adam"
    assert hook_name(_config("ddpx.optim.OneBitAdam", "onebit_adam")) == "onebit_adam"
    assert hook_name(_config("torch.optim.AdamW", "int8")) == "int8"
    with pytest.raises(DdpxError, match="set comm_hook.name: onebit_adam .* not 'int8'"):
        hook_name(_config("ddpx.optim.OneBitAdam", "int8"))
    with pytest.raises(DdpxError, match="comm_hook.name onebit_adam needs optimizer.target: ddpx.optim.OneBitAdam"):
        hook_name(_config("torch.optim.AdamW", "onebit_adam"))


@pytest.mark.slow
def test_ddpx_train_with_one_config_change_and_a_resume(ranks, tmp_path):
    """``optimizer.target: ddpx.optim.OneBitAdam`` alone pairs it with its hook, under bf16
    autocast, accumulation, clipping and weight decay; a second launch resumes from the
    checkpoint (Adam's state, the hook's error memory) and trains on in the compressed stage."""
    import json

    def train(epochs):
        return ranks.cli(["train", f"run_dir={tmp_path}/run", "logging.progress=false", "logging.every_steps=5",
                          "optimizer.target=ddpx.optim.OneBitAdam", "optimizer.args={lr: 0.003, weight_decay: 0.1}",
                          "comm_hook.options={warmup_steps: 8, min_numel: 1024}", "amp.enabled=true",
                          "amp.dtype=bf16", "accumulation.steps=2", "trainer.grad_clip=1.0",
                          f"trainer.epochs={epochs}", "--nproc-per-node", "2"], timeout=180, cwd=tmp_path)

    code, _, err = train(2)
    assert code == 0, err
    assert "comm hook onebit_adam installed (Python hook" in err
    code, _, err = train(4)
    assert code == 0, err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [0, 1, 2, 3] and epochs[-1]["accuracy"] > 0.85, epochs
    steps = [r for r in records if r["kind"] == "step" and r.get("comm_wire_bytes_per_step")]
    # 1-bit updates after the resume (its step lines count from the resume, not the restored totals)
    assert steps[-1]["step"] > 40 and steps[-1]["comm_wire_bytes_per_step"] < steps[0]["comm_wire_bytes_per_step"] / 8


def test_a_coordinate_without_gradient_in_the_warmup_steps_no_further_than_adam_can():
    """Its frozen second moment is 0: unbounded, its first gradient would step by m / eps."""
    from ddpx.optim import adam_step_bound

    w = torch.nn.Parameter(torch.zeros(2))
    state = ddpx.comm_hooks.make_state("onebit_adam")
    opt = ddpx.optim.OneBitAdam([w], comm=state, lr=0.1, betas=(0.9, 0.99), weight_decay=0.0)
    w.grad = torch.tensor([1.0, 0.0])
    opt.step()  # the warm-up (an exact AdamW step): coordinate 1 saw no gradient
    state.compressing = True
    state.average = lambda params, tensors: None  # one rank: the average is its own update
    before = w.detach().clone()
    w.grad = torch.tensor([1.0, 1.0])
    opt.step()
    moved = (w.detach() - before).abs()
    bound = 0.1 * adam_step_bound(0.9, 0.99) / (1 - 0.9 ** 2)  # lr x bound / the step's bias correction
    assert 0 < moved[1] <= bound + 1e-6 and 0 < moved[0] < bound

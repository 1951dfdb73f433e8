"""What the comm-hook tests share: the hook names under test, the tolerances of the
lossy ones, the comparisons, a small DDP training run with a hook, and a training
run on the digits (test modules do not import each other)."""

import copy
import logging

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpx.comm_hooks
from ddpx.data import digits_split

LOSSY = ["fp16", "bf16", "int8"]
ALL = ["allreduce"] + LOSSY
PART2 = ["onebit", "powersgd"]  # the hooks added after ALL (ALL + PART2 is every hook); both warm up by default
# options that make a hook compress from the first step (onebit and powersgd warm up by default)
NO_WARMUP = {"onebit": {"warmup_steps": 0}, "powersgd": {"warmup_steps": 0}}
# max |hook - exact| / max |exact| per parameter after one step (first step: no error feedback yet)
REL_TOL = {"fp16": 2e-3, "bf16": 2e-2, "int8": 3e-2}


def equal_lists(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def max_rel_err(got, ref):
    return max(float((g - r).abs().max() / r.abs().max().clamp_min(1e-12)) for g, r in zip(got, ref))


class Net(torch.nn.Module):
    """Small MLP; `unused` is never called (find_unused_parameters)."""

    def __init__(self, unused=False):
        super().__init__()
        self.fc1 = torch.nn.Linear(20, 200)
        self.fc2 = torch.nn.Linear(200, 200)
        self.fc3 = torch.nn.Linear(200, 10)
        self.unused = torch.nn.Linear(200, 200) if unused else None

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def make_model(unused=False):
    torch.manual_seed(0)
    return Net(unused)


def batch(step, rank, micro=0):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(16, 20, generator=g), torch.randint(0, 10, (16,), generator=g)


def layouts(state) -> list:
    """The state's bucket layouts (scope=inter_node: its plan's)."""
    if state is None:
        return []
    plan = getattr(state, "_plan", None)
    return list(state.layouts.values()) + list(getattr(plan, "layouts", {}).values())


def train(hook, native=False, steps=3, rank=0, mode=None, model=None, state_sd=None, first_step=0,
          inject=None, opt_sd=None, bucket_cap_mb=0.05, adamw=False, **options):
    """Train `steps` SGD (or AdamW) steps; returns grads per step, final params, stats, states.

    mode: None | "no_sync" | "static_graph" | "find_unused" | "bucket_view".
    inject: (step, rank, value) puts `value` into one element of fc2.weight's gradient.
    """
    net = model if model is not None else make_model(unused=mode == "find_unused")
    kwargs = {"bucket_cap_mb": bucket_cap_mb}
    if mode == "static_graph":
        kwargs["static_graph"] = True
    if mode == "find_unused":
        kwargs["find_unused_parameters"] = True
    if mode == "bucket_view":
        kwargs["gradient_as_bucket_view"] = True
    ddp = DDP(net, **kwargs)
    state = ddpx.comm_hooks.register(ddp, hook, native=native, **options) if hook else None
    if state is not None and state_sd is not None:
        state.load_state_dict(state_sd)
    if adamw:
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    if opt_sd is not None:
        opt.load_state_dict(opt_sd)
    if state is not None:
        state.pair(opt)  # after a loaded state dict, before the first step: as the ddpx trainer pairs
    cur = {"step": -1}
    if inject is not None:
        def poison(g):
            if cur["step"] == inject[0] and rank == inject[1]:
                g = g.clone()
                g.view(-1)[7] = inject[2]
            return g

        net.fc2.weight.register_hook(poison)
    grads, saved = [], None
    for step in range(first_step, first_step + steps):
        cur["step"] = step
        opt.zero_grad()
        if mode == "no_sync":
            with ddp.no_sync():
                x, y = batch(step, rank, micro=1)
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
        x, y = batch(step, rank)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        grads.append([p.grad.clone() for p in net.parameters() if p.grad is not None])
        if all(bool(torch.isfinite(g).all()) for g in grads[-1]):  # skip like GradScaler does
            opt.step()
        if step == first_step + steps // 2 - 1 and state is not None:
            saved = (copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict()), state.state_dict())
    return {
        "grads": grads,
        "params": [p.detach().clone() for p in net.parameters()],
        "stats": state.stats() if state else None,
        "native": state.native if state else None,
        "memory": {k: {kk: t.clone() for kk, t in d.items()} for k, d in state.memory.items()} if state else {},
        "saved": saved,
        "pieces": [len(lay.pieces) for lay in state.layouts.values() if hasattr(lay, "pieces")] if state else [],
        "blocks": sorted({pc.block for lay in layouts(state) for pc in getattr(lay, "pieces", ())
                          if hasattr(pc, "block")}),
    }


# ---------------------------------------------- onebit and powersgd on the digits
DIGITS_BATCH = 32


def digits_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                               torch.nn.ReLU(), torch.nn.Linear(128, 10))


class DigitsRun:
    """DDP training on this rank's shard of the digits; batch t is a function of t only."""

    def __init__(self, rank, world, name, opts, native=False, bucket_cap_mb=0.005):
        self.model = digits_mlp()
        # small buckets: every weight matrix in its own bucket, several in flight
        self.ddp = DDP(self.model, bucket_cap_mb=bucket_cap_mb)
        self.state = ddpx.comm_hooks.register(self.ddp, name, native=native, **opts) if name else None
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        if self.state is not None:
            self.state.pair(self.opt)
        train, self.test = digits_split()
        x, y = train.tensors
        self.x, self.y = x[rank::world], y[rank::world]
        self.per_epoch = len(self.y) // DIGITS_BATCH

    def batch(self, t):
        epoch, i = divmod(t, self.per_epoch)
        perm = torch.randperm(len(self.y), generator=torch.Generator().manual_seed(epoch))
        idx = perm[i * DIGITS_BATCH:(i + 1) * DIGITS_BATCH]
        return self.x[idx], self.y[idx]

    def steps(self, start, stop):
        for t in range(start, stop):
            x, y = self.batch(t)
            self.opt.zero_grad()
            torch.nn.functional.cross_entropy(self.ddp(x), y).backward()
            self.opt.step()

    def accuracy(self):
        x, y = self.test.tensors
        with torch.no_grad():
            return (self.model(x).argmax(1) == y).float().mean().item() * 100

    def flat(self):
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])

    def snapshot(self):
        return copy.deepcopy({"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                              "hook": self.state.state_dict()})

    def restore(self, snap, hook=True):
        self.model.load_state_dict(snap["model"])
        self.opt.load_state_dict(snap["opt"])
        if hook:
            self.state.load_state_dict(snap["hook"])


class WarningRecords(logging.Handler):
    """The messages of the warnings it is given (add it to a logger)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())

"""``ddpx bench comm``: which comm hook makes a step of *your* model faster on *your* link.

Launched like ``ddpx train`` (same config, overrides and launcher options, on
the job's ranks). Each rank builds the configured model and data, then:

1. link: a timed fp32 allreduce of a buffer the size of the gradients gives
   the rate at which one rank sends (ring model: 2 (R-1)/R x bytes);
2. compute: forward + backward of one optimizer step (``accumulation.steps``
   micro-batches of ``trainer.batch_size``) inside ``no_sync()``, i.e. without
   communication;
3. per hook: the predicted step time, compute + (bytes the hook sends per
   step) / (link rate), and the measured one, a real DDP step with that hook in
   ``--rounds`` rounds interleaved with the plain allreduce step (each round the
   median of ``--steps`` steps, the slowest rank's; the order alternates, so that
   load that comes and goes on the machine hits both), with the DDP options the
   hook asks for (``ddpx.comm_hooks.ddp_options``, what ``ddpx train`` applies).
   Also timed once, as a block, for reference: the hook with DDP's defaults,
   ``DDP(model)`` + ``ddpx.comm_hooks.register`` as a plain script writes it (only
   the config's own ``trainer`` DDP options), so the report shows what the options buy.

On a job of more than one node with more than one rank each (as the launcher
tells it: ddpx/comm_hooks/scope.py), every hook is also timed with ``scope:
inter_node`` (exact inside a node, compressed across nodes), the fp32 allreduce is
also timed inside a node and across nodes, and the recommendation names the scope.

The baseline row ``allreduce`` is DDP's own fp32 allreduce (no hook). A hook
is advised only when the link matters (the isolated allreduce is at least 15%
of compute + allreduce) and its step is at least 10% faster than the baseline's
in every round (a difference larger than the spread of the rounds); otherwise
the answer is "no compression" (no significant difference). When
communication dominates a step (the small-batch trap) it says so and suggests
gradient accumulation or a larger batch. The prediction assumes no overlap of
communication with the backward pass (an upper bound where compute is small).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

from ..errors import DdpxError
from ..launch import options, torchrun
from ..launch.options import add_launch_arguments
from ..net import MAX_ACCUMULATION_ADVICE, accumulation_advice

BENCH_MODULE = "ddpx.bench.comm"
BASELINE = "allreduce"  # DDP's built-in fp32 allreduce, no hook
MIN_SPEEDUP = 1.10  # a hook must make the step at least 10 % faster to be worth its loss of precision
COMM_BOUND_SHARE = 0.5  # communication above this share of a step: communication dominates
NEGLIGIBLE_SHARE = 0.15  # below this share compression cannot win anything worth having
SMALL_BATCH = 8
ENV_OUT, ENV_HOOKS, ENV_STEPS, ENV_ROUNDS = "DDPX_BENCH_OUT", "DDPX_BENCH_HOOKS", "DDPX_BENCH_STEPS", "DDPX_BENCH_ROUNDS"
DESCRIPTION = (
    "Measure which comm hook makes a training step of your model faster on your link, and recommend one "
    "or none. It takes the same config, overrides and launcher options as `ddpx train` and runs on the "
    "job's ranks: a timed fp32 allreduce of the gradients (the link), forward and backward without "
    "communication (the compute), then a real DDP step with each hook in --rounds rounds interleaved with "
    "the plain allreduce step. A hook is recommended only when the link matters (the allreduce is at least "
    f"{100 * NEGLIGIBLE_SHARE:.0f}% of a step) and it is at least {100 * (MIN_SPEEDUP - 1):.0f}% faster in every "
    "round; otherwise the answer is no compression (no significant difference). docs/cluster.md explains "
    "the report."
)


@dataclass
class HookTiming:
    name: str
    wire_bytes: int  # bytes one rank sends per step (ring model)
    predicted_s: float
    measured_s: Optional[float]  # with the DDP options the hook asks for (ddpx.comm_hooks.ddp_options)
    error: str = ""
    defaults_s: Optional[float] = None  # DDP(model) with DDP's defaults + ddpx.comm_hooks.register
    scope: str = "global"  # the hook's scope option (ddpx/comm_hooks/scope.py); wire_bytes: across nodes for inter_node
    rounds: list = field(default_factory=list)  # [baseline_s, hook_s] per interleaved round; measured_s: their median


def speedups(h: HookTiming, base_s: float) -> list:
    """The hook's speedup over the baseline in each round (the baseline's step over the hook's,
    timed side by side); without rounds, the one ratio of the medians."""
    return [b / t for b, t in h.rounds] if h.rounds else [base_s / h.measured_s]


@dataclass
class Measurement:
    world_size: int
    batch_size: int  # per rank, per micro-batch
    accumulation: int
    grad_bytes: int
    link_bytes_per_s: float  # what one rank sends per second in a ring allreduce
    allreduce_s: float  # fp32 allreduce of the gradients
    compute_s: float  # one optimizer step without communication: the median of compute_rounds
    hooks: list = field(default_factory=list)  # [HookTiming], the baseline first
    compute_rounds: list = field(default_factory=list)  # [baseline_s, compute_s] per interleaved round
    nodes: int = 1  # as the launcher tells them (ddpx/comm_hooks/scope.py); 1 where it does not
    ranks_per_node: int = 0
    intra_allreduce_s: Optional[float] = None  # fp32 allreduce of the gradients inside a node
    inter_allreduce_s: Optional[float] = None  # ... among one local rank of every node


# --- the decision (pure: unit-tested with synthetic measurements) ---------------------


def ring_bytes(nbytes: int, world: int) -> int:
    return 2 * (world - 1) * nbytes // world


def predict_step_s(compute_s: float, wire_bytes: int, link_bytes_per_s: float) -> float:
    """Compute plus the hook's bytes on the measured link (no overlap assumed)."""
    return compute_s + (wire_bytes / link_bytes_per_s if link_bytes_per_s > 0 else 0.0)


def recommend(m: Measurement) -> dict:
    """The advice for a measurement: best hook (or none), communication share, small-batch trap.

    Whether the link is a bottleneck is judged from the isolated allreduce
    (``link_share`` = allreduce / (compute + allreduce)): compression only cuts
    bytes on the wire, and the measured steps also carry noise and CPU
    contention that no hook removes. Only then is a hook chosen, from the
    measured steps. ``comm_share`` (measured step minus compute, over the step)
    is everything communication costs; above one half it is the small-batch trap.
    """
    timings = {h.name: h for h in m.hooks}
    base = timings.get(BASELINE)
    base_s = base.measured_s if base and base.measured_s else predict_step_s(
        m.compute_s, ring_bytes(m.grad_bytes, m.world_size), m.link_bytes_per_s)
    comm_s = max(0.0, base_s - m.compute_s)
    share = comm_s / base_s if base_s > 0 else 0.0
    link_share = m.allreduce_s / (m.compute_s + m.allreduce_s) if m.allreduce_s > 0 else 0.0
    candidates = [h for h in m.hooks if h.name != BASELINE and h.measured_s and not h.error]
    scoped = len({h.scope for h in candidates}) > 1
    ratios = {id(h): speedups(h, base_s) for h in candidates}
    # clearly faster: by MIN_SPEEDUP even in its worst round; of those, the one whose worst round is best
    # (with none, the best median, named in the answer)
    clear = [h for h in candidates if min(ratios[id(h)]) >= MIN_SPEEDUP]
    if clear:
        best = max(clear, key=lambda h: min(ratios[id(h)]))
    else:
        best = max(candidates, key=lambda h: statistics.median(ratios[id(h)]), default=None)
    speedup = statistics.median(ratios[id(best)]) if best else 1.0
    lines = []
    advice = {"comm_share": share, "link_share": link_share, "baseline_s": base_s, "comm_s": comm_s,
              "hook": None, "scope": None, "speedup": 1.0, "small_batch_trap": False, "slower_than_one_process": False,
              "accumulation_steps": None}
    pct = f"{100 * share:.0f}%"
    if link_share < NEGLIGIBLE_SHARE or not clear:
        if link_share < NEGLIGIBLE_SHARE:
            why = (f"the gradient allreduce takes {1e3 * m.allreduce_s:.1f} ms, only {100 * link_share:.0f}% "
                   "of a step: the link is not the bottleneck")
        else:
            why = f"no hook makes the step {100 * (MIN_SPEEDUP - 1):.0f}% faster"
            if best:
                r = ratios[id(best)]
                spread = f", {min(r):.2f}x-{max(r):.2f}x over {len(r)} rounds" if len(r) > 1 else ""
                why += (f" in every round, no significant difference (best: {best.name} scope {best.scope}, "
                        f"{speedup:.2f}x{spread})")
        lines.append(f"recommendation: no compression (comm_hook.name: {BASELINE}): {why}; "
                     "compression would only add work and error")
    else:
        advice.update(hook=best.name, scope=best.scope, speedup=speedup)
        other = [h for h in candidates if h.name == best.name and h.scope != best.scope]
        versus = f"; scope {other[0].scope}: {1e3 * other[0].measured_s:.1f} ms" if other and scoped else ""
        r = ratios[id(best)]
        spread = f", at least {min(r):.2f}x in each of {len(r)} rounds" if len(r) > 1 else ""
        lines.append(f"recommendation: comm_hook.name: {best.name}, comm_hook.options.scope: {best.scope} -- step "
                     f"{speedup:.2f}x faster ({1e3 * base_s:.1f} -> {1e3 * best.measured_s:.1f} ms{versus}{spread}); "
                     "it is lossy: check convergence on a short run first")
    if share > COMM_BOUND_SHARE:
        k = accumulation_advice(comm_s, m.compute_s, m.accumulation)
        advice.update(small_batch_trap=True, accumulation_steps=k)
        small = f" (batch {m.batch_size} per rank is below ~{SMALL_BATCH})" if m.batch_size < SMALL_BATCH else ""
        if k is None:
            less_often = "a larger accumulation.steps or trainer.batch_size"
        elif k < MAX_ACCUMULATION_ADVICE:
            less_often = (f"accumulation.steps: {k} (or a {k}x larger trainer.batch_size) makes compute at least as "
                          "long as the allreduce")
        else:
            less_often = (f"accumulation.steps: {k} (or a {k}x larger trainer.batch_size), the most ddpx advises: "
                          "compute stays shorter than the allreduce, compress the gradients too")
        lines.append(f"communication dominates the step ({pct}): the small-batch trap{small}. Communicate less "
                     f"often: {less_often}")
    # one process alone does batch_size samples per compute_s; the job does world * that per base_s
    if m.world_size > 1 and base_s > m.world_size * m.compute_s:
        advice["slower_than_one_process"] = True
        lines.append(f"with {m.world_size} ranks a step takes {1e3 * base_s:.1f} ms vs {1e3 * m.compute_s:.1f} ms "
                     "of compute: the job trains fewer samples per second than one process alone would")
    advice["lines"] = lines
    return advice


def below_compute_note(m: Measurement, below: list) -> str:
    """Why a measured step can come out below compute (no step is faster than its own forward and
    backward): noise of the same size as what communication adds."""
    spread = ""
    if len(m.compute_rounds) > 1:
        times = [c for _, c in m.compute_rounds]
        spread = f" (compute {1e3 * min(times):.2f}-{1e3 * max(times):.2f} ms over its {len(times)} rounds)"
    return (f"measured ms below compute ms ({', '.join(below)}): no step is faster than its forward and backward; "
            f"communication adds less than the steps' noise here{spread}, and DDP overlaps the allreduce with the "
            "backward pass")


def _label(h: HookTiming) -> str:
    return h.name if h.scope == "global" or h.name == BASELINE else f"{h.name} {h.scope}"


def format_report(m: Measurement, advice: dict) -> str:
    gb = 1e9
    lines = [
        f"ranks {m.world_size}, batch {m.batch_size} per rank x accumulation {m.accumulation}, "
        f"gradients {m.grad_bytes / 1e6:.2f} MB",
        f"link: fp32 allreduce of the gradients {1e3 * m.allreduce_s:.2f} ms "
        f"({m.link_bytes_per_s / gb:.3f} GB/s sent per rank)",
        f"nodes: {m.nodes} x {m.ranks_per_node} ranks" + (
            f"; fp32 allreduce inside a node {1e3 * m.intra_allreduce_s:.2f} ms, across nodes (one rank per node) "
            f"{1e3 * m.inter_allreduce_s:.2f} ms" if m.intra_allreduce_s is not None else
            " (scope inter_node needs more than one node with more than one rank each: only global measured)"),
        f"compute (forward + backward, no communication): {1e3 * m.compute_s:.2f} ms per step",
        f"communication share of a step with {BASELINE}: {100 * advice['comm_share']:.0f}% measured, "
        f"{100 * advice.get('link_share', 0.0):.0f}% from the link alone",
        "",
        f"{'hook':<20} {'MB sent/step':>12} {'predicted ms':>13} {'measured ms':>12} {'vs ' + BASELINE:>13} "
        f"{'rounds':>13} {'DDP defaults ms':>16} {'vs ' + BASELINE:>13}",
    ]
    base_s = advice["baseline_s"]
    for h in m.hooks:
        if h.error:
            lines.append(f"{_label(h):<20} {'':>12} {'':>13} {'failed':>12}  {h.error}")
            continue
        r = speedups(h, base_s) if h.measured_s and h.name != BASELINE else []
        ratio = f"{statistics.median(r):.2f}x" if r else ("1.00x" if h.measured_s else "-")
        spread = f"{min(r):.2f}-{max(r):.2f}x" if len(r) > 1 else "-"
        measured = f"{1e3 * h.measured_s:.2f}" if h.measured_s else "-"
        defaults = f"{1e3 * h.defaults_s:.2f}" if h.defaults_s else "-"
        dratio = f"{base_s / h.defaults_s:.2f}x" if h.defaults_s else "-"
        lines.append(f"{_label(h):<20} {h.wire_bytes / 1e6:>12.3f} {1e3 * h.predicted_s:>13.2f} {measured:>12} "
                     f"{ratio:>13} {spread:>13} {defaults:>16} {dratio:>13}")
    lines.append("measured ms: DDP(model, **ddpx.comm_hooks.ddp_options(name)), as ddpx train wraps it, the median of "
                 "the rounds; vs allreduce: the median of the rounds' speedups, rounds: their range; DDP defaults ms: "
                 "DDP(model) + ddpx.comm_hooks.register(ddp, name), timed once; inter_node rows: MB sent across nodes")
    below = [_label(h) for h in m.hooks if h.measured_s and h.measured_s < m.compute_s]
    if below:
        lines.append(below_compute_note(m, below))
    lines.append("")
    lines += advice["lines"]
    return "\n".join(lines)


# --- measuring (every rank, same collectives in the same order) ------------------------


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(seconds: Sequence[float], device) -> list:
    """The slowest rank's value of each (every rank gets them)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(list(seconds), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _median_step_s(step, steps: int, device) -> float:
    """This rank's median of ``steps`` timed steps, each started together on every rank."""
    import torch.distributed as dist

    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time_steps(step, steps: int, device, warmup: int = 2) -> float:
    for _ in range(warmup):
        step()
    _sync(device)
    return _slowest([_median_step_s(step, steps, device)], device)[0]


def _time_rounds(base_step, hook_step, rounds: int, steps: int, device) -> list:
    """[baseline_s, hook_s] for each of ``rounds`` rounds, each the median of ``steps`` steps (the
    slowest rank's). The two alternate, and which goes first alternates too, so that load that comes
    and goes on the machine (other jobs, turbo, page cache) hits both alike."""
    base_step()
    hook_step()
    _sync(device)
    pairs = []
    for r in range(rounds):
        order = (base_step, hook_step) if r % 2 == 0 else (hook_step, base_step)
        first, second = (_median_step_s(step, steps, device) for step in order)
        pairs.append((first, second) if r % 2 == 0 else (second, first))
    flat = _slowest([s for pair in pairs for s in pair], device)
    return [flat[i:i + 2] for i in range(0, len(flat), 2)]


def _step_fn(ddp, loss_fn, batch, accumulation: int, communicate: bool):
    """One optimizer step's forward/backward (no optimizer: parameters stay put)."""
    import contextlib

    from ..data.batches import model_loss

    def step():
        ddp.zero_grad(set_to_none=True)
        for i in range(accumulation):
            last = communicate and i == accumulation - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                model_loss(ddp, loss_fn, batch)[0].backward()

    return step


def measure(trainer, hook_names: Optional[Sequence[str]] = None, steps: int = 3, rounds: int = 5) -> Measurement:
    """Every rank: link, compute and per-hook step times for ``trainer``'s model and batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..net import measure_allreduce_seconds
    from ..data.batches import to_device
    from ..strategies.ddp import ddp_kwargs

    device, world = trainer.device, trainer.world_size
    if world < 2:
        raise DdpxError("ddpx bench comm needs at least 2 ranks (e.g. --nproc-per-node 2, or several nodes)")
    accumulation = int(trainer.config.section("accumulation").get("steps", 1)) if "accumulation" in trainer.config else 1
    batch = to_device(next(iter(trainer.train_loader)), device)
    params = [p for p in trainer.module.parameters() if p.requires_grad]
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    device_ids = [device] if device.type == "cuda" else None

    allreduce_s = measure_allreduce_seconds(grad_bytes, device=device)
    link = ring_bytes(grad_bytes, world) / allreduce_s if allreduce_s > 0 else 0.0

    def fresh_ddp(preferred=None):  # wrapped as the trainer's ddp strategy would with that hook
        options = ddp_kwargs(trainer.config, preferred or {})
        return DDP(copy.deepcopy(trainer.module), device_ids=device_ids, **options)

    baseline = fresh_ddp()  # kept: every hook's rounds alternate with its steps
    base_step = _step_fn(baseline, trainer.loss_fn, batch, accumulation, True)
    # compute in rounds beside the allreduce step too, as the hooks are timed: a single block of it,
    # timed once, took load that came and went on a shared machine for a difference between hooks
    compute_rounds = _time_rounds(base_step, _step_fn(baseline, trainer.loss_fn, batch, accumulation, False),
                                  rounds, steps, device)
    compute_s = statistics.median(c for _, c in compute_rounds)
    measured = statistics.median(b for b, _ in compute_rounds)
    base_wire = ring_bytes(grad_bytes, world)
    m = Measurement(world, trainer.config.trainer.batch_size, accumulation, grad_bytes, link, allreduce_s, compute_s,
                    compute_rounds=compute_rounds)
    m.hooks.append(HookTiming(BASELINE, base_wire, predict_step_s(compute_s, base_wire, link), measured))

    try:
        import ddpx.comm_hooks as hooks
        from ddpx.comm_hooks.scope import topology
    except Exception as exc:  # noqa: BLE001 - the baseline is still worth reporting
        trainer.log.warning(f"ddpx.comm_hooks does not load ({exc}); measuring the baseline only")
        return m
    import torch.distributed as dist

    names = list(hook_names) if hook_names is not None else [n for n in hooks.available() if n != BASELINE]
    native = bool(trainer.config.section("comm_hook").get("native", True)) if "comm_hook" in trainer.config else True
    scopes = ["global"]
    topo = topology(dist.group.WORLD)  # the nodes as the launcher tells them (every rank)
    if topo.reason is None:
        m.nodes, m.ranks_per_node = topo.nodes, topo.local_world
    if topo.local_group is not None:  # more than one node, more than one rank each: both scopes
        m.intra_allreduce_s = measure_allreduce_seconds(grad_bytes, group=topo.local_group, device=device)
        m.inter_allreduce_s = measure_allreduce_seconds(grad_bytes, group=topo.cross_group, device=device)
        scopes.append("inter_node")
    for name, scope in [(n, s) for n in names for s in scopes]:
        if name == BASELINE:
            continue
        options = dict(hooks.without_warmup(name), **({} if scope == "global" else {"scope": scope}))
        ddp = fresh_ddp(hooks.ddp_options(name) if name in hooks.available() else None)  # else: fails below
        step = _step_fn(ddp, trainer.loss_fn, batch, accumulation, True)
        try:  # a hook that fails here fails the same way on every rank
            state = hooks.register(ddp, name, native=native, **options)
            step()  # one step to learn the bytes the hook sends per step
        except Exception as exc:  # noqa: BLE001 - reported in the table, the other hooks still run
            m.hooks.append(HookTiming(name, 0, 0.0, None, f"{type(exc).__name__}: {exc}"[:200], scope=scope))
            continue
        wire = int(state.stats()["wire_bytes"]) // max(1, state.stats()["steps"])
        paired = _time_rounds(base_step, step, rounds, steps, device)
        seconds = statistics.median(hook_s for _, hook_s in paired)
        del ddp, state
        # the same hook as a plain script gets it: DDP(model) (only the config's own options)
        ddp = fresh_ddp()
        step = _step_fn(ddp, trainer.loss_fn, batch, accumulation, True)
        state = hooks.register(ddp, name, native=native, **options)
        defaults = _time_steps(step, steps, device, warmup=2)
        m.hooks.append(HookTiming(name, wire, predict_step_s(compute_s, wire, link), seconds, defaults_s=defaults,
                                  scope=scope, rounds=paired))
        del ddp, state
    paired_base = [b for b, _ in compute_rounds] + [b for h in m.hooks for b, _ in h.rounds]
    m.hooks[0].measured_s = statistics.median(paired_base)  # the baseline row: every round it ran in
    return m


def run_rank(config_path: Optional[str], overrides: Sequence[str]) -> int:
    """One rank of ``ddpx bench comm`` (inside torchrun)."""
    from ..config import load_config
    from ..train.trainer import Trainer

    config = load_config(config_path, overrides)
    with Trainer(config) as trainer:  # close() on every exit path
        trainer.setup()
        hooks_env = os.environ.get(ENV_HOOKS)
        names = [n for n in hooks_env.split(",") if n] if hooks_env else None
        m = measure(trainer, names, steps=int(os.environ.get(ENV_STEPS, "3")),
                    rounds=int(os.environ.get(ENV_ROUNDS, "5")))
        if trainer.rank == 0:
            advice = recommend(m)
            out = os.environ.get(ENV_OUT)
            payload = {"measurement": asdict(m), "advice": advice}
            if out:
                with open(out, "w") as f:
                    json.dump(payload, f)
            else:
                print(format_report(m, advice), flush=True)
    return 0


def main(argv=None) -> int:
    from ..worker import parse_args

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run_rank(args.config, args.overrides)
    except DdpxError as exc:
        print(f"ddpx: error: [rank{os.environ.get('RANK', '0')}] {exc}", file=sys.stderr, flush=True)
        return exc.exit_code


# --- the command ------------------------------------------------------------------------


def register(subparsers):
    p = subparsers.add_parser(
        "comm",
        help="measure link bandwidth and step compute, then recommend a comm hook (or none)",
        description=DESCRIPTION,
    )
    _add_launch_arguments(p)
    p.add_argument("--hooks", default=None, help="comma-separated hooks to measure (default: every ddpx hook)")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds per hook, each alternating the hook's steps with the plain allreduce's (default 5)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per round and setting (their median; default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _add_launch_arguments(p):
    p.add_argument("config", nargs="?", default=None, help="YAML config (omit for the built-in digits run)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    add_launch_arguments(p, restarts=False)


def run(args) -> int:
    from ..config import load_config, split_config_and_overrides

    for flag, value in (("--steps", args.steps), ("--rounds", args.rounds)):
        if value < 1:
            raise DdpxError(f"{flag} must be at least 1, got {value}")
    config_path, overrides = split_config_and_overrides(args.config, args.overrides)
    config = load_config(config_path, overrides)
    opts = dataclasses.replace(options.options_from_args(args), max_restarts=0)
    # The ranks' trainer needs a run_dir, and rank 0 writes its report: both in a directory that
    # goes when the command ends, so that a measurement leaves no run behind under runs/.
    work = tempfile.mkdtemp(prefix="ddpx-bench-comm-")
    out = os.path.join(work, "report.json")
    try:
        argv = torchrun.torchrun_argv(opts, config.launch, config_path, [*overrides, f"run_dir={work}"])
        argv[argv.index("--module") + 1] = BENCH_MODULE
        if "--nproc-per-node=1" in argv and "--nnodes=1" in argv:
            raise DdpxError("ddpx bench comm needs at least 2 ranks: use --nproc-per-node 2 or several nodes")
        os.environ.update({ENV_OUT: out, ENV_STEPS: str(args.steps), ENV_ROUNDS: str(args.rounds)})
        if args.hooks:
            os.environ[ENV_HOOKS] = args.hooks
        torchrun.run_torchrun(argv)
        text = ""
        if os.path.exists(out):  # not where rank 0 runs on another node
            with open(out) as f:
                text = f.read()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not text:
        print("ddpx bench comm: rank 0 runs on another node; the report is printed there", file=sys.stderr)
        return 0
    payload = json.loads(text)
    if args.json:
        print(json.dumps(payload, indent=2))
    else:
        m = payload["measurement"]
        m["hooks"] = [HookTiming(**h) for h in m["hooks"]]
        print(format_report(Measurement(**m), payload["advice"]))
    return 0


if __name__ == "__main__":
    from ..collector import run_program

    run_program(main)

"""Convergence matrix of the lossy comm hooks at their default options.

What a user of an imported hook writes: a plain torchrun DDP script
(``DistributedSampler`` + ``set_epoch``, ``DDP(model)`` with DDP's defaults)
plus one line, ``ddpx.comm_hooks.register(ddp, name)``, no options (and ``state.pair(opt)``). For every cell
of

    model (an MLP, a small CNN with BatchNorm on the 8x8 images)
    x optimizer (SGD momentum 0.9, Adam)
    x per-rank batch (16, 128)
    x run length (short: 3 epochs, long: 12 epochs)

it trains the same seeded model with no hook (plain allreduce) and with every
lossy hook, on the UCI digits (ddpx.data, 2 ranks, gloo), and reports each
hook's final test accuracy minus the no-hook accuracy of the same cell.

One launch of 2 workers loops over every cell (start-up paid once):

    python benchmarks/bench_convergence.py                   # the full matrix, a table
    python benchmarks/bench_convergence.py --json out.json   # also the numbers
    python benchmarks/bench_convergence.py --models mlp --optimizers sgd --batches 16 --runs short \\
        --hooks onebit,powersgd

Without ``RANK`` in the environment it starts itself under
``torch.distributed.run --nproc_per_node 2`` (``--nproc`` changes that).

Two levels (``scope: inter_node``, ddpx/comm_hooks/scope.py) on one machine:
``--nproc 4 --nodes 2`` tells the ranks, as torchrun would on 2 nodes, that they
are 2 nodes of 2 (``GROUP_RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), and
``--scope inter_node`` adds that option to every hook (``--bound`` sets the
verdict's bound, e.g. 1.0 for inter_node)::

    python benchmarks/bench_convergence.py --nproc 4 --nodes 2 --scope inter_node --bound 1.0

``--seeds N`` runs every cell with N seeds and reports the mean difference:
one seed cannot tell a hook's effect from the way that seed's trajectory
reacts to any small perturbation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from benchjson import hook_spec

MODELS = ("mlp", "cnn")
OPTIMIZERS = ("sgd", "adam")
BATCHES = (16, 128)
RUNS = {"short": 3, "long": 12}  # epochs
LOSSY = ("fp16", "bf16", "int8", "onebit", "powersgd")
BOUND = 1.5  # points of test accuracy


def make_model(kind: str) -> torch.nn.Module:
    if kind == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                                   torch.nn.ReLU(), torch.nn.Linear(128, 10))
    if kind == "cnn":

        def block(cin, cout):
            return [torch.nn.Conv2d(cin, cout, 3, padding=1, bias=False), torch.nn.BatchNorm2d(cout),
                    torch.nn.ReLU()]

        return torch.nn.Sequential(torch.nn.Unflatten(1, (1, 8, 8)), *block(1, 16), *block(16, 32),
                                   torch.nn.MaxPool2d(2), *block(32, 64), torch.nn.AdaptiveAvgPool2d(1),
                                   torch.nn.Flatten(), torch.nn.Linear(64, 10))
    raise ValueError(f"unknown model {kind!r}; known: {', '.join(MODELS)}")


def make_optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    raise ValueError(f"unknown optimizer {kind!r}; known: {', '.join(OPTIMIZERS)}")


def parse_hook(spec: str):
    """'onebit' or 'onebit:warmup_steps=50:chunk_size=64' -> (name, options)."""
    return hook_spec(spec, ":")


def train_cell(model: str, optimizer: str, batch: int, epochs: int, hook: str | None, seed: int = 0) -> dict:
    """One training run in the seed's style; returns the test accuracy (identical on every rank).
    ``hook``: None (no hook: DDP's own allreduce), a hook name (its default options, as
    most users register it) or ``name:option=value,...``."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    import ddpx.comm_hooks
    from ddpx.data import digits_split

    train, test = digits_split()
    torch.manual_seed(seed)
    net = make_model(model)
    ddp = DDP(net)  # DDP's defaults, as most users write it
    if hook:
        name, options = parse_hook(hook)
        state = ddpx.comm_hooks.register(ddp, name, **options)  # no options: the hook's defaults
    else:
        state = None
    opt = make_optimizer(optimizer, ddp.parameters())
    if state is not None:
        state.pair(opt)  # before the first step: powersgd's rank auto is 16 with Adam
    sampler = DistributedSampler(train, seed=seed)
    loader = DataLoader(train, batch_size=batch, sampler=sampler)
    steps, curve = 0, []
    tx, ty = test.tensors
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            steps += 1
        net.eval()
        with torch.no_grad():
            curve.append(round(float((net(tx).argmax(1) == ty).float().mean()) * 100, 2))
    acc = curve[-1]
    check = torch.tensor([acc], dtype=torch.float64)
    dist.all_reduce(check, op=dist.ReduceOp.MAX)
    stats = state.stats() if state else None
    return {"acc": acc, "curve": curve, "replicas_agree": float(check) == acc, "steps": steps,
            "compression": stats["compression"] if stats else None}


def run_matrix(models=MODELS, optimizers=OPTIMIZERS, batches=BATCHES, runs=tuple(RUNS), hooks=LOSSY,
               seed: int = 0, log=None, seeds: int = 1) -> list[dict]:
    """Every cell, every hook (inside an initialised 2-rank group); one row per cell.

    With ``seeds`` > 1 every run of a cell is repeated with the seeds ``seed``,
    ``seed + 1``, ...: one seed's trajectory reacts to any perturbation (even
    fp16's), so a cell's ``delta`` is then the mean over seeds of the hook's
    accuracy minus allreduce's with the same seed (``deltas``: each seed's)."""
    rows = []
    for model in models:
        for optimizer in optimizers:
            for batch in batches:
                for run in runs:
                    t0 = time.perf_counter()
                    row = {"model": model, "optimizer": optimizer, "batch": batch, "run": run,
                           "epochs": RUNS[run], "hooks": {}}
                    cell_seeds = range(seed, seed + seeds)
                    bases = [train_cell(model, optimizer, batch, RUNS[run], None, s) for s in cell_seeds]
                    row["allreduce"] = statistics.fmean(b["acc"] for b in bases)
                    row["allreduce_by_seed"] = [b["acc"] for b in bases]
                    row["allreduce_curve"] = bases[0]["curve"]
                    row["steps"] = bases[0]["steps"]
                    for hook in hooks:
                        results = [train_cell(model, optimizer, batch, RUNS[run], hook, s) for s in cell_seeds]
                        r = results[0]
                        r["deltas"] = [h["acc"] - b["acc"] for h, b in zip(results, bases)]
                        r["delta"] = statistics.fmean(r["deltas"])
                        r["acc"] = statistics.fmean(h["acc"] for h in results)
                        r["replicas_agree"] = all(h["replicas_agree"] for h in results)
                        row["hooks"][hook] = r
                    row["seeds"] = list(cell_seeds)
                    row["seconds"] = time.perf_counter() - t0
                    rows.append(row)
                    if log:
                        log(row)
    return rows


def worst(rows) -> dict:
    """{hook: the largest accuracy loss (points) over the cells}."""
    out = {}
    for row in rows:
        for hook, r in row["hooks"].items():
            out[hook] = max(out.get(hook, float("-inf")), -r["delta"])
    return out


def table(rows, hooks) -> str:
    head = ["model", "optim", "batch", "epochs", "steps", "allreduce %"] + [f"{h} Δ" for h in hooks]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["model"], row["optimizer"], str(row["batch"]), str(row["epochs"]), str(row["steps"]),
                 f"{row['allreduce']:.1f}"]
        cells += [f"{round(row['hooks'][h]['delta'], 1) + 0.0:+.1f}" for h in hooks]  # no "-0.0"
        lines.append("| " + " | ".join(cells) + " |")
    w = worst(rows)
    lines.append("| worst loss | | | | | | " + " | ".join(f"{w[h] + 0.0:.1f}" for h in hooks) + " |")  # no "-0.0"
    return "\n".join(lines)


def _csv(text, cast=str):
    return tuple(cast(v) for v in text.split(",") if v)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--runs", default=",".join(RUNS), help="short (3 epochs), long (12 epochs)")
    p.add_argument("--hooks", default=",".join(LOSSY),
                   help="comma-separated hooks, each NAME or NAME:option=value:option=value "
                        "(e.g. onebit:warmup_steps=0); default: every lossy hook at its default options")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=1,
                   help="seeds per cell (--seed, --seed + 1, ...): each cell reports the mean difference")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--nodes", type=int, default=1, help="pretend nodes the --nproc ranks are split into")
    p.add_argument("--scope", default=None, help="the hooks' scope option (global, inter_node, auto)")
    p.add_argument("--bound", type=float, default=BOUND, help="points of test accuracy the verdict allows")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="write the rows as JSON (to FILE, or stdout)")
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error(f"--seeds {args.seeds}: at least 1")
    if args.nodes < 1 or args.nproc % args.nodes:
        p.error(f"--nodes {args.nodes} must divide --nproc {args.nproc}")
    if args.scope:
        args.hooks = ",".join(f"{h}:scope={args.scope}" for h in _csv(args.hooks))
    for run in _csv(args.runs):
        if run not in RUNS:
            p.error(f"--runs: unknown run {run!r}; known: {', '.join(RUNS)}")
    return args


def worker(args) -> int:
    import torch.distributed as dist

    from ddpx.rank import process_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.nodes > 1:  # what torchrun tells the ranks of `nodes` nodes
        per_node = dist.get_world_size() // args.nodes
        os.environ.update(GROUP_RANK=str(rank // per_node), LOCAL_RANK=str(rank % per_node),
                          LOCAL_WORLD_SIZE=str(per_node))

    def log(row):
        if rank == 0:
            deltas = " ".join(f"{h} {r['delta']:+.1f}" for h, r in row["hooks"].items())
            print(f"{row['model']} {row['optimizer']} b{row['batch']} {row['run']}: allreduce "
                  f"{row['allreduce']:.1f}% | {deltas} ({row['seconds']:.0f} s)", file=sys.stderr, flush=True)

    rows = run_matrix(_csv(args.models), _csv(args.optimizers), _csv(args.batches, int), _csv(args.runs),
                      _csv(args.hooks), args.seed, log, args.seeds)
    if rank == 0:
        hand_rows_back(rows)
    process_group.teardown()
    return 0


ROWS_OUT = "DDPX_BENCH_CONVERGENCE_OUT"  # where rank 0 writes its rows for the launching process


def hand_rows_back(rows) -> None:
    """Rank 0's rows, to the process that started the ranks (:func:`rows_from_ranks`)."""
    out = os.environ.get(ROWS_OUT)
    if out:
        with open(out, "w") as f:
            json.dump(rows, f)


def rows_from_ranks(script: str, argv, nproc: int = 2):
    """Run ``script argv`` on ``nproc`` ranks under torchrun; rank 0's rows, or torchrun's exit code."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        env = dict(os.environ, OMP_NUM_THREADS="1", **{ROWS_OUT: out})
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               os.path.abspath(script), *argv]
        rc = subprocess.call(cmd, env=env)
        if rc:
            return rc
        with open(out) as f:
            return json.load(f)


def write_json(dest: str, report: dict) -> None:
    """``--json [FILE]``: the report to FILE, or to stdout for ``-``."""
    text = json.dumps(report, indent=1)
    if dest == "-":
        print(text)
    else:
        with open(dest, "w") as f:
            f.write(text)


def _without_nproc(argv):
    """The workers' arguments: --nproc is the launcher's (torchrun takes "--nproc" for its own
    --nproc-per-node, ambiguously, even after the script)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if "RANK" in os.environ:
        return worker(args)
    rows = rows_from_ranks(__file__, _without_nproc(sys.argv[1:] if argv is None else argv), args.nproc)
    if isinstance(rows, int):
        return rows
    hooks = _csv(args.hooks)
    print(table(rows, hooks))
    bad = {h: round(v, 2) for h, v in worst(rows).items() if v > args.bound}
    print(f"\nevery hook within {args.bound} points of allreduce in every cell: {'yes' if not bad else f'no {bad}'}")
    if args.json:
        write_json(args.json, {"bound": args.bound, "nproc": args.nproc, "nodes": args.nodes, "seeds": args.seeds,
                               "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

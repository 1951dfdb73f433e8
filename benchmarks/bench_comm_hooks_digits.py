"""Every ddpx comm hook across 2 ranks over gloo on the digits default (DigitsMLP(128),
batch 32 per rank, SGD lr 0.1 momentum 0.9, 10 epochs), on one device: the replicas
must be identical after training and each hook's test accuracy within 1.5 points of
no hook's. On a GPU both ranks share it (gloo with CUDA tensors: NCCL refuses two
ranks on one device), which runs the CUDA encode/decode across ranks.

Each hook runs as users get it: ``ddpx.comm_hooks.register(ddp, name)`` with its
defaults (native C++ where it has one; powersgd and onebit warm up first).

Usage: python benchmarks/bench_comm_hooks_digits.py [--device cuda|cpu] [--hooks all] [--epochs 10]
       [--timeout 240] [--json] [--out FILE]
Exit status 1 when a hook misses either check.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

from benchjson import emit

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MAX_ACCURACY_DROP = 0.015


def train(hook: str | None, device: str, epochs: int, rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader

    import ddpx.comm_hooks
    from ddpx.data import digits_split
    from ddpx.data.sampler import ResumableDistributedBatchSampler
    from ddpx.models import DigitsMLP

    torch.manual_seed(0)
    model = DigitsMLP(hidden=128).to(device)
    ddp = DDP(model, **(ddpx.comm_hooks.ddp_options(hook) if hook else {}))
    state = ddpx.comm_hooks.register(ddp, hook) if hook else None
    train_set, test_set = digits_split(test_fraction=0.2, seed=0)
    sampler = ResumableDistributedBatchSampler(len(train_set), 32, rank, world, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if state is not None:
        state.pair(opt)
    start = time.perf_counter()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            torch.nn.functional.cross_entropy(ddp(x.to(device)), y.to(device)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    replicas = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(replicas, flat)
    x, y = test_set.tensors
    with torch.no_grad():
        accuracy = float((model(x.to(device)).argmax(1).cpu() == y).float().mean())
    result = {"accuracy": accuracy, "replica_max_abs_diff": max(float((r - flat).abs().max()) for r in replicas),
              "native": getattr(state, "native", None), "seconds": seconds}
    if state is not None:
        state.close()
    del ddp, state
    gc.collect()
    return result


def rank_main(device: str, hooks: list[str], epochs: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from ddpx.rank import process_group

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    results = {"none": train(None, device, epochs, rank, world)}
    for hook in hooks:
        try:
            results[hook] = train(hook, device, epochs, rank, world)
        except Exception as exc:  # noqa: BLE001 - reported per hook; the other hooks still run
            results[hook] = {"error": f"{type(exc).__name__}: {exc}"}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    process_group.teardown()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (torch + gloo abort there now and then)


def verdicts(results: dict) -> dict:
    base = results["none"]["accuracy"]
    out = {}
    for hook, r in results.items():
        if "error" in r:
            out[hook] = {"ok": False, "why": r["error"]}
            continue
        problems = []
        if r["replica_max_abs_diff"] != 0:
            problems.append(f"replicas differ by up to {r['replica_max_abs_diff']:.3g}")
        if r["accuracy"] < base - MAX_ACCURACY_DROP:
            problems.append(f"accuracy {r['accuracy']:.4f} is more than 1.5 points below no hook's {base:.4f}")
        out[hook] = {"ok": not problems, "why": "; ".join(problems)}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--hooks", default="all", help="comma-separated names, or all")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--rank-main", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import ddpx.comm_hooks

    hooks = ddpx.comm_hooks.available() if args.hooks == "all" else args.hooks.split(",")
    if args.rank_main:
        rank_main(args.device, hooks, args.epochs, args.rank_main)
    import tempfile

    import torch

    from ddpx.net import free_port

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device; run with --device cpu")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        port = str(free_port())
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2",
                   PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, __file__, "--device", args.device, "--hooks", ",".join(hooks), "--epochs",
               str(args.epochs), "--rank-main", out]
        procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(2)]
        deadline = time.monotonic() + args.timeout
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                codes.append(f"timed out after {args.timeout:.0f} s")
        if not os.path.exists(out):
            print(f"bench_comm_hooks_digits: the ranks wrote no result (exit codes {codes})", file=sys.stderr)
            return 1
        with open(out) as f:
            results = json.load(f)
    report = {"device": args.device, "torch": torch.__version__, "epochs": args.epochs, "results": results,
              "verdicts": verdicts(results)}
    report["ok"] = all(v["ok"] for v in report["verdicts"].values())
    if not emit(report, args.out, args.json):
        for hook, r in results.items():
            v = report["verdicts"][hook]
            detail = r.get("error") or (f"accuracy {r['accuracy']:.4f}, replicas differ by {r['replica_max_abs_diff']:.3g}, "
                                        f"native {r['native']}, {r['seconds']:.1f} s")
            print(f"{hook:>10}: {'ok' if v['ok'] else 'FAIL ' + v['why']} ({detail})")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

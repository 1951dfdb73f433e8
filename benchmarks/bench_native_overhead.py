"""Per-bucket overhead of the native C++ comm hooks vs the Python ones.

Two ranks on loopback gloo (the wire is not the limit), a model of many small
layers and a tiny ``bucket_cap_mb`` so that each step hands DDP's reducer many
small buckets. For each hook the step time is measured with the native hook
(``ddpx.comm_hooks.register(..., native=True)``: no Python, no GIL per bucket) and
with the Python hook (``native=False``), plus DDP's own built-in allreduce for
reference; the per-bucket overhead is the difference divided by the number of
buckets per step.

    python benchmarks/bench_native_overhead.py [--layers 200] [--steps 30] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

from ddpx.net import free_port


def _run(rank, world, port, args, out_file):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpx.comm_hooks
    from ddpx.rank import process_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    x = torch.randn(8, args.width)

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])

    def timed(ddp, state=None):
        times = []
        for i in range(args.warmup + args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            ddp.zero_grad()
            ddp(x).sum().backward()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[args.warmup:]) * 1e3

    results = {"layers": args.layers, "width": args.width, "bucket_cap_mb": args.bucket_cap_mb, "rows": []}
    ddp = DDP(model(), bucket_cap_mb=args.bucket_cap_mb)
    results["builtin_ms"] = timed(ddp)
    for name in args.hooks:
        row = {"hook": name}
        for native in (True, False):
            ddp = DDP(model(), bucket_cap_mb=args.bucket_cap_mb)
            state = ddpx.comm_hooks.register(ddp, name, native=native)
            state.pair(None)  # no optimizer steps here
            ms = timed(ddp, state)
            s = state.stats()
            row["buckets"] = s["buckets"] // s["steps"]
            row["native_ms" if native else "python_ms"] = ms
            row["native_registered" if native else "python_registered"] = state.native
        row["overhead_us_per_bucket"] = (row["python_ms"] - row["native_ms"]) * 1e3 / row["buckets"]
        results["rows"].append(row)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(results, f)
    process_group.teardown()


def _entry(rank, world, port, args, out_file):  # torch.multiprocessing target
    _run(rank, world, port, args, out_file)


def table(r):
    lines = [f"{r['layers']} x Linear({r['width']}, {r['width']}), bucket_cap_mb={r['bucket_cap_mb']}, "
             f"2 ranks on loopback gloo; DDP built-in allreduce: {r['builtin_ms']:.2f} ms/step",
             f"{'hook':<10} {'buckets':>8} {'native ms':>10} {'python ms':>10} {'python - native per bucket':>27}"]
    for row in r["rows"]:
        lines.append(f"{row['hook']:<10} {row['buckets']:>8} {row['native_ms']:>10.2f} {row['python_ms']:>10.2f} "
                     f"{row['overhead_us_per_bucket']:>24.1f} us")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=200)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--bucket-cap-mb", type=float, default=0.004, help="tiny: about one layer per bucket")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--hooks", nargs="*", default=["allreduce", "fp16", "int8"])
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "r.json")
        mp.start_processes(_entry, args=(2, free_port(), args, out_file), nprocs=2, start_method="spawn")
        with open(out_file) as f:
            results = json.load(f)
    print(json.dumps(results, indent=2) if args.json else table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

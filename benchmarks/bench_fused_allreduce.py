"""Fused allreduce of many small tensors vs one all_reduce per tensor.

Default: 1,000 fp32 tensors of 1 KB each, 2 ranks on loopback gloo (CPU).
Timed per repetition (median over --reps, after a warm-up):

* ``separate``: 1,000 ``dist.all_reduce`` calls, each waited for (the usual loop);
* ``separate_async``: 1,000 ``dist.all_reduce(async_op=True)`` then wait for all;
* ``fused``: ``ddpx.fused_allreduce.fused_allreduce(tensors, op="sum").wait()``;
* ``fused_fp16``: the same with ``compression="fp16"``.

Every rank checks that the fused result equals the per-tensor result.

Usage: python benchmarks/bench_fused_allreduce.py [--world 2] [--tensors 1000]
       [--bytes 1024] [--reps 20] [--json]
Run it on a real cluster with torchrun instead (it then uses the launched group):
       torchrun --nnodes N ... benchmarks/bench_fused_allreduce.py --json
"""

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddpx.rank import process_group


def _timed(fn, reps):
    fn()  # warm-up (connections, allocations)
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(args):
    from ddpx.fused_allreduce import fused_allreduce

    rank = dist.get_rank()
    numel = args.bytes // 4
    g = torch.Generator().manual_seed(rank)
    base = [torch.randn(numel, generator=g) for _ in range(args.tensors)]

    def separate():
        for t in base:
            dist.all_reduce(t.clone())

    def separate_async():
        works = [dist.all_reduce(t.clone(), async_op=True) for t in base]
        for w in works:
            w.wait()

    def fused(compression=None):
        tensors = [t.clone() for t in base]
        fused_allreduce(tensors, op="sum", compression=compression).wait()
        return tensors

    ref = [t.clone() for t in base]
    for t in ref:
        dist.all_reduce(t)
    correct = all(torch.equal(a, b) for a, b in zip(fused(), ref))

    # the clones are part of every variant, so they cancel in the ratios
    result = {
        "world_size": dist.get_world_size(),
        "tensors": args.tensors,
        "bytes_per_tensor": args.bytes,
        "separate_ms": _timed(separate, args.reps),
        "separate_async_ms": _timed(separate_async, args.reps),
        "fused_ms": _timed(fused, args.reps),
        "fused_fp16_ms": _timed(lambda: fused("fp16"), args.reps),
        "fused_equals_separate": correct,
    }
    result["speedup_vs_separate"] = result["separate_ms"] / result["fused_ms"]
    result["speedup_vs_separate_async"] = result["separate_async_ms"] / result["fused_ms"]
    return result


def _report(result, as_json):
    if as_json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['tensors']} tensors x {result['bytes_per_tensor']} B, {result['world_size']} ranks (gloo)")
    for key in ("separate_ms", "separate_async_ms", "fused_ms", "fused_fp16_ms"):
        print(f"  {key[:-3]:<16} {result[key]:9.2f} ms")
    print(f"  fused is {result['speedup_vs_separate']:.1f}x faster than separate calls "
          f"({result['speedup_vs_separate_async']:.1f}x vs separate async); "
          f"results identical: {result['fused_equals_separate']}")


def _worker(rank, world, port, args, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        result = measure(args)
        if rank == 0:
            queue.put(result)
    finally:
        process_group.teardown()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="local ranks when not launched by torchrun")
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--bytes", type=int, default=1024, help="bytes per tensor (fp32)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.bytes < 4:
        parser.error("--bytes must be at least 4 (one fp32 element)")

    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        result = measure(args)
        if dist.get_rank() == 0:
            _report(result, args.json)
        process_group.teardown()
        return 0

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(args.world, port, args, queue), nprocs=args.world, start_method="spawn")
    _report(queue.get(), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

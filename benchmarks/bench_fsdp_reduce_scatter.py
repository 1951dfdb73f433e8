"""Bytes, time and gradient error of FSDP2's gradient reduce-scatter: fp32 (FSDP's own) vs
ddpx's fp16, bf16 and int8 (``comm_hook.name`` under ``trainer.strategy: fsdp``,
ddpx/comm_hooks/reduce_scatter.py).

The char GPT example's model (examples/char_gpt, 0.82 M parameters: 4 block units + the
root), sharded over 2 local gloo ranks (CPU); per method, after a warm-up, the median
time of a forward + backward over --steps steps (the same batches for every method) and
the bytes each rank sent per step in the reduce-scatters (the comm's ``stats()``; fp32:
(R-1) x 4 bytes per element of a rank's chunk, as a ring or pairwise reduce-scatter
sends). The gradient error is ||g - g_fp32|| / ||g_fp32|| of the first step's sharded
gradients. Times on a shared CPU are noisy: compare the methods of one run.

Usage: python benchmarks/bench_fsdp_reduce_scatter.py [--world 2] [--steps 10] [--json] [--out FILE]
"""

import argparse
import datetime
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
# int8's block_size auto is 256 here (no optimizer steps); 64 is what it becomes with AdamW
METHODS = ("fp32", "fp16", "bf16", "int8", "int8:block_size=64")


def _model():
    sys.path.insert(0, str(ROOT / "examples" / "char_gpt"))
    from gpt import GPT

    torch.manual_seed(0)
    return GPT(vocab_size=128, block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.0)


def measure(args) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from benchjson import hook_spec

    from ddpx.comm_hooks import reduce_scatter

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 128, (16, 65), generator=g) for _ in range(args.steps + 1)]
    result, reference = {"world_size": world, "steps": args.steps, "methods": {}}, None
    for method in METHODS:
        model = _model()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        comm = None
        if method != "fp32":
            name, options = hook_spec(method, ",")
            comm = reduce_scatter.make(name, **options)
            comm.pair(None)  # no optimizer steps here: block_size auto is 256
            reduce_scatter.install(model, comm)
        times = []
        for i, batch in enumerate(batches):
            model.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            loss = model(batch[:, :-1], batch[:, 1:])
            loss.backward()
            times.append(time.perf_counter() - start)
            if i == 0:
                grad = torch.cat([p.grad.to_local().flatten() for p in model.parameters()])
                reference = grad if method == "fp32" else reference
                error = ((grad - reference).norm() / reference.norm()).item()
                first = comm.stats() if comm is not None else None
        row = {"step_ms": 1e3 * statistics.median(times[1:]), "grad_relative_error": error}
        if comm is not None:
            stats = comm.stats()
            steps = stats["steps"] - first["steps"]
            row["wire_bytes_per_step"] = (stats["wire_bytes"] - first["wire_bytes"]) / steps
            fp32_per_step = (stats["fp32_wire_bytes"] - first["fp32_wire_bytes"]) / steps
            result["methods"].setdefault("fp32", {})["wire_bytes_per_step"] = fp32_per_step
            row["bytes_vs_fp32"] = row["wire_bytes_per_step"] / fp32_per_step
        result["methods"].setdefault(method, {}).update(row)
    result["methods"]["fp32"]["bytes_vs_fp32"] = 1.0
    fp32_ms = result["methods"]["fp32"]["step_ms"]
    for row in result["methods"].values():
        row["step_time_vs_fp32"] = row["step_ms"] / fp32_ms
    return result


def _report(result, as_json, out):
    from benchjson import emit

    if emit(result, out, as_json):
        return
    print(f"FSDP2 gradient reduce-scatter, char GPT model, {result['world_size']} gloo ranks, "
          f"{result['steps']} steps (median)")
    print(f"  {'method':<18} {'bytes/step':>12} {'vs fp32':>8} {'step ms':>9} {'vs fp32':>8} {'grad error':>11}")
    for name, row in result["methods"].items():
        print(f"  {name:<18} {row['wire_bytes_per_step']:12.0f} {row['bytes_vs_fp32']:8.3f} {row['step_ms']:9.1f} "
              f"{row['step_time_vs_fp32']:8.2f} {row['grad_relative_error']:11.2e}")


def _worker(rank, world, port, args, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        result = measure(args)
        if rank == 0:
            queue.put(result)
    finally:
        from ddpx.rank import process_group

        process_group.teardown()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="local gloo ranks")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per method (after one warm-up)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(args.world, port, args, queue), nprocs=args.world, start_method="spawn")
    _report(queue.get(), args.json, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What ``trainer.find_unused_parameters: true`` costs per step (the figure ddpx's
"got no gradient" error quotes): plain ``DDP(model)`` with and without it, 2 gloo
ranks, on the digits MLP (batch 32, SGD) and on the char GPT example's model
(0.82 M parameters, batch 32 x 64 characters, AdamW), every parameter used.

Runs alternate (off, on, off, on, ...) inside one launch, so machine load hits both
alike; the verdict is the median of the paired ratios (on / off) per model.

Usage: python benchmarks/bench_find_unused.py [--rounds 15] [--steps 40] [--json] [--out FILE]
(without ``RANK`` in the environment it starts itself under ``torch.distributed.run``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from benchjson import emit

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples", "char_gpt"))


def digits():
    from ddpx.models import DigitsMLP

    model = DigitsMLP(hidden=128)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), \
        lambda m: torch.nn.functional.cross_entropy(m(x), y)


def gpt():
    from gpt import GPT  # examples/char_gpt/gpt.py

    model = GPT(vocab_size=128, block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.1)
    idx, targets = torch.randint(0, 128, (32, 64)), torch.randint(0, 128, (32, 64))
    return model, torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1), \
        lambda m: m(idx, targets)


MODELS = {"digits": digits, "gpt": gpt}


def step_time(build, find_unused: bool, steps: int) -> float:
    torch.manual_seed(0)
    model, optimizer, loss_of = build()
    ddp = DDP(model, find_unused_parameters=find_unused)
    for i in range(steps + 5):
        if i == 5:
            dist.barrier()
            start = time.perf_counter()
        loss_of(ddp).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    return (time.perf_counter() - start) / steps


def rank_main(args) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    report = {"rounds": args.rounds, "steps": args.steps, "world_size": dist.get_world_size(), "models": {}}
    for name, build in MODELS.items():
        ratios, off_s, on_s = [], [], []
        for _ in range(args.rounds):
            off, on = step_time(build, False, args.steps), step_time(build, True, args.steps)
            off_s.append(off)
            on_s.append(on)
            ratios.append(on / off)
        report["models"][name] = {"off_step_ms": round(statistics.median(off_s) * 1e3, 3),
                                  "on_step_ms": round(statistics.median(on_s) * 1e3, 3),
                                  "cost_percent": round((statistics.median(ratios) - 1) * 100, 1)}
    if dist.get_rank() == 0 and not emit(report, args.out, args.json):
        for name, r in report["models"].items():
            print(f"{name:7s} find_unused_parameters off {r['off_step_ms']:.2f} ms/step, on {r['on_step_ms']:.2f} "
                  f"ms/step: +{r['cost_percent']:.1f} % (median of {args.rounds} paired rounds)")
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if "RANK" in os.environ:
        rank_main(args)
        return 0
    env = {"TORCH_CPP_LOG_LEVEL": "ERROR", **os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [
        HERE, os.environ.get("PYTHONPATH")]))}
    from ddpx.net import free_port

    return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                            "--master-addr", "127.0.0.1", "--master-port", str(free_port("127.0.0.1")),
                            os.path.abspath(__file__), *sys.argv[1:]], env=env)


if __name__ == "__main__":
    sys.exit(main())

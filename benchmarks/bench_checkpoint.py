"""How long a checkpoint save blocks the training loop, compared with one local copy.

The model is 12 x Linear(1024, 1024) (about 50 MB of fp32). For each repetition:

* ``copy``: copying every tensor of the state into fresh CPU memory (the
  reference: "one local copy"; from the GPU with ``--device cuda``);
* ``async_blocking``: the time ``AsyncCheckpointWriter.save`` keeps the caller
  (snapshot to CPU; serialization and fsync run on a background thread);
* ``sync_save``: a synchronous atomic save (serialize + fsync + rename), i.e.
  what the loop would wait for without the background writer.

Usage: python benchmarks/bench_checkpoint.py [--reps 5] [--dir DIR] [--device cpu|cuda] [--json]
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ddpx.rank.checkpoint_files import AsyncCheckpointWriter, CheckpointDirectory


def build_model(layers=12, width=1024):
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--device", default="cpu", help="where the model lives (cpu, cuda)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = build_model().to(args.device)
    sync = torch.cuda.synchronize if model[0].weight.is_cuda else (lambda: None)
    nbytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory = CheckpointDirectory(Path(tmp), keep=2)
        writer = AsyncCheckpointWriter(directory, async_write=True)
        sync_writer = AsyncCheckpointWriter(directory, async_write=False)
        copy_s, blocking_s, sync_s, write_s = [], [], [], []
        step = 0
        for _ in range(args.reps):
            copy_s.append(timed(lambda: ({k: v.to("cpu", copy=True) for k, v in model.state_dict().items()}, sync())))
            step += 1
            blocking_s.append(timed(lambda: writer.save({"model": model.state_dict()}, step)))
            write_s.append(blocking_s[-1] + timed(writer.wait))  # until it is on disk
            step += 1
            sync_s.append(timed(lambda: sync_writer.save({"model": model.state_dict()}, step)))
    result = {
        "model_mb": round(nbytes / 2**20, 1),
        "device": args.device,
        "reps": args.reps,
        "copy_ms": round(1e3 * statistics.median(copy_s), 2),
        "async_blocking_ms": round(1e3 * statistics.median(blocking_s), 2),
        "async_until_durable_ms": round(1e3 * statistics.median(write_s), 2),
        "sync_save_ms": round(1e3 * statistics.median(sync_s), 2),
    }
    result["blocking_over_copy"] = round(result["async_blocking_ms"] / result["copy_ms"], 2)
    result["sync_over_blocking"] = round(result["sync_save_ms"] / result["async_blocking_ms"], 2)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>24}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

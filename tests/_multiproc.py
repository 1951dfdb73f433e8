"""Run a test function in several fresh processes joined by a gloo group.

``run_workers(fn, world_size)`` starts one Python process per rank (this file
as a script), initialises ``torch.distributed`` with gloo on a free loopback
port, calls ``fn(rank, world_size, *args)`` and returns the ranks' return values
(passed back with torch.save). A hard timeout kills every rank, so a hang fails
the test with each rank's stderr instead of stalling the suite.
"""

from __future__ import annotations

import datetime
import gc
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from utils import free_port  # noqa: E402


def run_workers(fn, world_size: int = 2, args: tuple = (), timeout: float = 90.0) -> list:
    module_path = sys.modules[fn.__module__].__file__
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        args_file = os.path.join(tmp, "args.pt")
        torch.save(args, args_file)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        procs = []
        for rank in range(world_size):
            cmd = [sys.executable, __file__, module_path, fn.__name__, str(rank), str(world_size), str(port),
                   args_file, os.path.join(tmp, f"rank{rank}.pt"), str(timeout)]
            with open(os.path.join(tmp, f"rank{rank}.err"), "w") as err:  # a file: a full pipe would block
                procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err))
        # poll: when one rank dies the others would wait for it until the gloo timeout
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.returncode not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
        timed_out = [r for r, p in enumerate(procs) if p.poll() is None]
        for p in procs:
            if p.poll() is None:
                p.kill()
        failed = []
        for rank, p in enumerate(procs):
            p.wait()
            with open(os.path.join(tmp, f"rank{rank}.err")) as f:
                err = f.read()
            if rank in timed_out:
                reason = f"was killed after {timeout:.0f}s" if time.monotonic() > deadline else "was stopped"
                failed.append(f"rank {rank} {reason}:\n{err[-3000:]}")
            elif p.returncode != 0:
                failed.append(f"rank {rank} exited with {p.returncode}:\n{err[-3000:]}")
        if failed:
            raise AssertionError("\n".join(failed))
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def _main(argv: list[str]) -> None:
    module_path, fn_name, rank, world, port, args_file, out_file, timeout = argv
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("_ddpx_test_module", module_path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(module_path))
    spec.loader.exec_module(module)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=float(timeout)))
    try:
        result = getattr(module, fn_name)(rank, world, *torch.load(args_file, weights_only=False))
        torch.save(result, out_file)
        del result
    finally:
        # DDP models and hook states hold the group: free them before destroying it,
        # or torch 2.13 + gloo aborts now and then ("terminate called without an
        # active exception").
        gc.collect()
        dist.destroy_process_group()
    # The result is saved; skip interpreter teardown, the other place that abort hits.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _main(sys.argv[1:])

"""The per-rank entry point torchrun starts: ``python -m ddpx.worker [--config PATH] [KEY=VALUE ...]``.

``ddpx train`` launches it; you can also run it under your own torchrun.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from torch.distributed.elastic.multiprocessing.errors import record

from .config import load_config
from .errors import DdpxError, TrainingDiverged
from .launch import DONE_DIR_ENV, LAUNCHER_PID_ENV
from .trainer import Trainer, TrainingStopped


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m ddpx.worker")
    parser.add_argument("--config", default=None, help="YAML config (default: the built-in digits run)")
    parser.add_argument("overrides", nargs="*", help="dotted KEY=VALUE overrides")
    return parser.parse_args(argv)


@record
def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    rank = os.environ.get("RANK", "0")
    stop_with_the_launcher(rank)
    try:
        config = load_config(args.config, args.overrides)
        trainer = Trainer(config)
        trainer.run()
        _mark_done(rank)
    except TrainingDiverged as exc:
        if os.environ.get("LOCAL_RANK", "0") == "0":  # every rank stops with the same message: one per node
            print(f"ddpx: error: training diverged: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except DdpxError as exc:
        print(f"ddpx: error: [rank{rank}] {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except TrainingStopped as exc:
        print(f"ddpx: [rank{rank}] {exc}", file=sys.stderr, flush=True)
        return 128 + exc.signum
    return 0


def stop_with_the_launcher(rank: str, poll_s: float = 1.0) -> None:
    """SIGTERM this worker once ``ddpx train``'s launcher has died. torchrun starts each
    worker in a session of its own, so a launcher killed with SIGKILL (the OOM killer,
    ``kill -9``, a job's time limit) would leave its workers training on, holding the GPUs
    and the run directory. SIGTERM takes the usual stop: the ranks agree on a step and save
    a final checkpoint. (Not prctl's PR_SET_PDEATHSIG: it sends one signal per thread, and a
    second SIGTERM means "exit now".)"""
    if not os.environ.get(LAUNCHER_PID_ENV):
        return  # started by a user's own torchrun, srun or mpirun: they manage their workers
    launcher = int(os.environ[LAUNCHER_PID_ENV])

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_s)
        print(f"ddpx: [rank{rank}] the launcher (pid {launcher}) is gone: stopping", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="ddpx-launcher-watch", daemon=True).start()


def _mark_done(rank: str) -> None:
    """Tell ``ddpx train``'s launcher this rank finished (see launch.DONE_DIR_ENV)."""
    done_dir = os.environ.get(DONE_DIR_ENV)
    if done_dir and os.path.isdir(done_dir):
        open(os.path.join(done_dir, f"rank-{rank}"), "w").close()


if __name__ == "__main__":
    sys.exit(main())

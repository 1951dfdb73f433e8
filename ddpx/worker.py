"""One rank of ``ddpx train``: what torchrun starts, ``python -m ddpx.worker [--config PATH] [KEY=VALUE ...]``.

``ddpx train`` launches it; you can also run it under your own torchrun.
"""

from __future__ import annotations

import argparse
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from .config import load_config
from .errors import DdpxError, TrainingDiverged
from .rank.launcher_contract import mark_done, stop_with_the_launcher
from .train.stopping import TrainingStopped
from .train.trainer import Trainer


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
    trainer = None
    try:
        config = load_config(args.config, args.overrides)
        trainer = Trainer(config)
        trainer.run()
        mark_done(rank)
    except DdpxError as exc:
        what = "training diverged: " if isinstance(exc, TrainingDiverged) else ""
        if not exc.same_on_every_rank:
            print(f"ddpx: error: [rank{rank}] {what}{exc}", file=sys.stderr, flush=True)
        elif os.environ.get("LOCAL_RANK", "0") == "0":  # every rank stops with the same message: one per node
            print(f"ddpx: error: {what}{exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except TrainingStopped as exc:
        print(f"ddpx: [rank{rank}] {exc}", file=sys.stderr, flush=True)
        return 128 + exc.signum
    except Exception:
        if trainer is None or trainer.peer_failure is None:
            raise
        # Another rank failed first: one line per node, not a traceback through the plugin that was
        # communicating (every local rank would say the same).
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"ddpx: [rank{rank}] {trainer.peer_failure}", file=sys.stderr, flush=True)
        return 1  # a crash (docs/checkpoints.md lists the exit codes)
    return 0


if __name__ == "__main__":
    sys.exit(main())

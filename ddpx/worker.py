"""One rank of ``ddpx train``: what torchrun starts, ``python -m ddpx.worker [--config PATH] [KEY=VALUE ...]``,
and :func:`fit` (``ddpx.fit``), the same rank called in a process that another launcher started.

``ddpx train`` launches it; you can also run it under your own torchrun, srun or mpirun, or
call :func:`fit` from Ray Train's train loop (docs/engines.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Mapping, Sequence, Union

if __name__ == "__main__":  # before torch loads, which takes seconds
    from .rank.launcher_contract import quiet_interrupt_while_starting

    quiet_interrupt_while_starting()

from torch.distributed.elastic.multiprocessing.errors import record

from .collector import run_program
from .config import load_config
from .console import CONSOLE_LOG, append_line, survive_closed_console
from .errors import DdpxError, show_tracebacks
from .launch.resume import resume_line
from .rank import failures
from .rank.launcher_contract import LAUNCHER_PID_ENV, launcher_alive, mark_done, stop_with_the_launcher
from .train.stopping import TrainingStopped
from .train.trainer import Trainer


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m ddpx.worker")
    parser.add_argument("--config", default=None, help="YAML config (default: the built-in digits run)")
    parser.add_argument("overrides", nargs="*", help="dotted KEY=VALUE overrides")
    return parser.parse_args(argv)


def fit(config: Union[str, Mapping, None] = None, overrides: Sequence[str] = ()) -> list[dict]:
    """Train one rank in this process; returns the metrics of each epoch it trained (``loss``,
    ``accuracy``, ``step``, ...: the ``metrics.jsonl`` epoch records; a run that resumed from a
    checkpoint in its ``run_dir`` starts there). Call it on every rank.

    ``config``: a YAML file, a dict shaped like one, or None for the built-in digits run;
    ``overrides``: ``KEY=VALUE`` strings as on ``ddpx train``'s command line. Where a default
    process group exists already (Ray Train's workers, your own ``init_process_group``), the
    run trains in it and leaves it as it was; otherwise it joins the group that torchrun's
    variables describe (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...), or trains alone:
    the rank :func:`main` runs. Errors are raised as they are (a launcher may pickle them: Ray
    does); a rank stopped by another rank's failure raises with a note naming the rank that
    failed first."""
    trainer = Trainer(load_config(config, overrides))
    try:
        return trainer.run()
    except Exception as exc:
        if trainer.peer_failure is not None:
            exc.add_note(f"ddpx: {trainer.peer_failure}")
        raise


@record
def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    rank = os.environ.get("RANK", "0")
    survive_closed_console()  # a console that closes (`| tee` and Ctrl-C) does not end the stop
    stop_with_the_launcher(rank)
    trainer = None
    try:
        trainer = Trainer(load_config(args.config, args.overrides))  # the rank fit runs, its failure reported here
        trainer.run()
        mark_done(rank)
    except TrainingStopped as exc:
        if not launcher_alive():  # else ddpx train says it, once for the node
            say_stopped(f"ddpx: [rank{rank}] {exc}", trainer, args, rank)
        return 128 + exc.signum
    except Exception as exc:
        report_failure(exc, trainer, rank)
        return exc.exit_code if isinstance(exc, DdpxError) else 1  # docs/checkpoints.md lists the exit codes
    return 0


def say_stopped(line: str, trainer, args, rank: str) -> None:
    """A stop without a launcher to say it (it died, or never was): this rank's line on the
    console and in the run's console.log, and rank 0's command that resumes the run."""
    lines = [line]
    run_dir = trainer.run_dir if trainer is not None else None
    if rank == "0" and run_dir is not None and os.environ.get(LAUNCHER_PID_ENV):  # a ddpx train whose launcher died
        lines.append(resume_line(args.config, args.overrides, str(run_dir)))
    for text in lines:
        print(text, file=sys.stderr, flush=True)
        if run_dir is not None:
            append_line(run_dir / CONSOLE_LOG, text)


def report_failure(exc: Exception, trainer, rank: str) -> None:
    """One line for the error that ended this rank, printed by the first failing rank of each
    node only (the others failed the same way, or because of it); an unexpected error's
    traceback comes with it, every rank's with DDPX_TRACEBACK=1."""
    peer_failure = trainer.peer_failure if trainer is not None else None
    line, unexpected = failures.failure_line(exc, peer_failure)
    store = trainer.failure_store if trainer is not None else None
    if store is None and getattr(exc, "same_on_every_rank", False):
        first = os.environ.get("LOCAL_RANK", "0") == "0"  # no store to ask: one rank per node says it
    else:
        first = failures.claim_report(store)
    if show_tracebacks() or (unexpected and first):
        traceback.print_exception(exc)
    if first:
        start = "\r\033[K" if sys.stderr.isatty() else ""  # over rank 0's progress bar, not after it
        if peer_failure is not None:
            print(f"{start}ddpx: [rank{rank}] {line}", file=sys.stderr, flush=True)
        else:
            prefix = "" if getattr(exc, "same_on_every_rank", False) else f"[rank{rank}] "
            print(f"{start}ddpx: error: {prefix}{line}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    run_program(main)

"""What a rank started by ``ddpx train`` shares with its launcher: two environment
variables, a done marker, and stopping when the launcher dies.

Workers started by a user's own torchrun, srun or mpirun find neither variable and
are left alone."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

DONE_DIR_ENV = "DDPX_DONE_DIR"  # each worker that finishes training writes a marker file here
LAUNCHER_PID_ENV = "DDPX_LAUNCHER_PID"  # the workers stop when this process dies


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


def launcher_alive() -> bool:
    """Whether this worker's ``ddpx train`` launcher runs (it then reports for the node)."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    return bool(launcher) and os.getppid() == int(launcher)


def mark_done(rank: str) -> None:
    """Tell the launcher this rank finished training (it then forgives a crash at exit)."""
    done_dir = os.environ.get(DONE_DIR_ENV)
    if done_dir and os.path.isdir(done_dir):
        open(os.path.join(done_dir, f"rank-{rank}"), "w").close()


def quiet_interrupt_while_starting() -> None:
    """Ctrl-C before the trainer takes SIGINT (while torch imports, the config loads): end this
    worker without a KeyboardInterrupt traceback per rank; ``ddpx train`` says it once. Call it
    first thing in a worker process (not where it is merely imported)."""
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(128 + signum))

"""What a rank started by ``ddpx train`` shares with its launcher: two environment
variables, a done marker, and stopping when the launcher dies; under ``elastic.recovery: live``
three more (the Lighthouse, its retries, and the replica group's name).

Workers started by a user's own torchrun, srun or mpirun find neither variable and
are left alone."""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time

from ..console import silence

DONE_DIR_ENV = "DDPX_DONE_DIR"  # each worker that finishes training writes a marker file here
LAUNCHER_PID_ENV = "DDPX_LAUNCHER_PID"  # the workers stop when this process dies
# elastic.recovery: live (ddpx/launch/live.py sets them for every worker of this node's replica group):
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # http://HOST:PORT of the run's `ddpx lighthouse` (torchft's Manager reads it)
QUORUM_RETRIES_ENV = "TORCHFT_QUORUM_RETRIES"  # elastic.lighthouse_retries (torchft's Manager reads it)
REPLICA_GROUP_ENV = "DDPX_REPLICA_GROUP"  # MASTER_ADDR:MASTER_PORT of this group: its name, unique in the run


def stop_with_the_launcher(rank: str, poll_s: float = 1.0) -> None:
    """SIGTERM this worker as soon as ``ddpx train``'s launcher has died. torchrun starts each
    worker in a session of its own and does nothing when its agent dies, so a launcher killed
    with SIGKILL (the OOM killer, ``kill -9``, a job's time limit) would leave its workers
    training on, holding the GPUs and the run directory. SIGTERM takes the usual stop: the ranks
    agree on a step and save a final checkpoint. On a terminal the shell's prompt is back once
    the launcher is gone, so the worker's console goes to /dev/null then (its ``ddpx`` log lines
    still reach the run's console.log). (Not prctl's PR_SET_PDEATHSIG: it fires when the
    launcher's thread that started the worker ends, and a second SIGTERM means "exit now".)"""
    if not os.environ.get(LAUNCHER_PID_ENV):
        return  # started by a user's own torchrun, srun or mpirun: they manage their workers
    launcher = int(os.environ[LAUNCHER_PID_ENV])

    def watch() -> None:
        _wait_for_exit(launcher, poll_s)
        if any(_isatty(fd) for fd in (1, 2)):
            for fd in (1, 2):
                silence(fd)
        logging.getLogger("ddpx").warning("the launcher (pid %d) is gone: stopping", launcher)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="ddpx-launcher-watch", daemon=True).start()


def _wait_for_exit(parent: int, poll_s: float) -> None:
    """Return once ``parent`` is no longer this process's parent: at once through a pidfd
    (Linux 5.3), else by polling."""
    try:
        pidfd = os.pidfd_open(parent)
    except (AttributeError, OSError):
        pidfd = None
    if pidfd is not None:
        try:
            if os.getppid() == parent:  # the pidfd is our parent's, not a reused pid's
                select.select([pidfd], [], [])  # readable when the process exits
            return
        finally:
            os.close(pidfd)
    while os.getppid() == parent:
        time.sleep(poll_s)


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


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

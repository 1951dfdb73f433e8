"""One run per ``run_dir``: a lock file naming its holder.

``<run_dir>/ddpx.lock`` holds ``{"host", "pid", "job", "started"}`` of the
process that trains there (rank 0 of the run). Another run on the same
``run_dir`` refuses to start, in one line naming the holder. A lock is stale,
and taken over with a warning, when its pid is not running on this host, or,
written on another host, when it was not refreshed for the lease
(``DDPX_LOCK_LEASE_S``, 300 s; the holder refreshes it every lease / 5).

The same job takes the lock over without a word: a worker group restarted by
``--max-restarts``, or re-formed after an elastic membership change (rank 0 may
then be on another node). ``ddpx train`` names the job in ``DDPX_JOB_ID``: the
rendezvous (``RDZV_ID@HOST:PORT``) across nodes, the launcher's host and pid on
one node. ``ddpx.fit`` in a process group a launcher created (Ray Train) names it
by that group's store (``store@HOST:PORT``): the parent pid there is Ray's raylet,
the same for every Ray job on the node. Workers started otherwise (torchrun, srun)
use their host and parent pid.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Optional

from ..errors import DdpxError

LOCK_NAME = "ddpx.lock"
JOB_ENV = "DDPX_JOB_ID"
LEASE_ENV = "DDPX_LOCK_LEASE_S"
DEFAULT_LEASE_S = 300.0

log = logging.getLogger("ddpx")


def job_id(group: Optional[str] = None) -> str:
    """``DDPX_JOB_ID``, else ``group`` (the store of a process group a launcher created:
    :func:`ddpx.rank.process_group.adopted_group_id`), else this host and the parent's pid."""
    return os.environ.get(JOB_ENV) or group or f"{socket.gethostname()}:{os.getppid()}"


def lease_s() -> float:
    try:
        return float(os.environ.get(LEASE_ENV, DEFAULT_LEASE_S))
    except ValueError:
        return DEFAULT_LEASE_S


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe(holder: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("started", 0))))
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {started}"


def read_holder(run_dir: Path) -> Optional[dict]:
    """The lock's holder, or None when there is no lock (an unreadable one counts as held by nobody)."""
    path = Path(run_dir) / LOCK_NAME
    try:
        holder = json.loads(path.read_text())
        holder["age_s"] = time.time() - path.stat().st_mtime
        return holder if isinstance(holder, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def stale_reason(holder: dict) -> Optional[str]:
    """Why the holder no longer holds the run (None: it does)."""
    if not holder.get("pid") or not holder.get("host"):
        return "an unreadable lock"
    if holder["host"] == socket.gethostname():
        return None if _pid_running(int(holder["pid"])) else f"pid {holder['pid']} is not running"
    if holder.get("age_s", 0.0) > lease_s():
        return f"not refreshed for {holder['age_s']:.0f} s (lease {lease_s():.0f} s, {LEASE_ENV})"
    return None


def refusal(run_dir: Path, holder: dict) -> str:
    return (f"run_dir {run_dir} is in use by another run ({describe(holder)}; lock {Path(run_dir) / LOCK_NAME}); "
            "wait for it, stop it, or choose another run_dir")


class RunLock:
    """The held lock; :meth:`release` removes it (if still ours). ``group``: see :func:`job_id`."""

    def __init__(self, run_dir: Path, group: Optional[str] = None):
        self.path = Path(run_dir) / LOCK_NAME
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id(group), "started": time.time()}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def acquire(self) -> None:
        """Take the lock or raise a one-line :class:`DdpxError` naming the holder."""
        for _ in range(3):  # a stale lock taken over by someone else in between: look again
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = read_holder(self.path.parent)
                if holder is None:
                    continue
                same_job = holder.get("job") == self.me["job"]
                reason = stale_reason(holder)
                if reason is None and not same_job:
                    raise DdpxError(refusal(self.path.parent, holder))
                if not same_job:
                    log.warning(f"taking over the stale lock of run_dir {self.path.parent} "
                                f"({describe(holder)}: {reason})")
                aside = self.path.with_name(f".{LOCK_NAME}.stale-{os.getpid()}")
                try:
                    os.replace(self.path, aside)  # atomic: only one taker moves it
                    aside.unlink(missing_ok=True)
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.me, f)
            self._start_refreshing()
            return
        raise DdpxError(f"cannot take the lock {self.path}: other runs keep taking it; choose another run_dir")

    def _start_refreshing(self) -> None:
        every = lease_s() / 5

        def refresh():
            while not self._stop.wait(every):
                try:
                    os.utime(self.path)
                except OSError:
                    return

        self._thread = threading.Thread(target=refresh, name="ddpx-run-lock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        holder = read_holder(self.path.parent)
        if holder and holder.get("pid") == self.me["pid"] and holder.get("host") == self.me["host"]:
            self.path.unlink(missing_ok=True)


def hold_run_dir(run_dir: Path, rank: int, world_size: int, group: Optional[str] = None) -> Optional[RunLock]:
    """Rank 0 takes the lock; every rank raises the same one-line error when it is held
    (one broadcast at set-up). Returns rank 0's lock (None on the others). ``group``: see :func:`job_id`."""
    lock = error = None
    if rank == 0:
        lock = RunLock(run_dir, group)
        try:
            lock.acquire()
        except DdpxError as exc:
            lock, error = None, str(exc)
    if world_size > 1:
        import torch.distributed as dist

        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise DdpxError(error)
    return lock

"""Blame only the guilty: which rank failed first.

When a rank fails, the collectives of the others break ("Connection closed by
peer", a timeout) inside whatever plugin was communicating at the time. That
plugin did nothing wrong. A rank that fails on its own writes its error to the
store (the first one wins); a rank whose collective broke reads it and says
"stopped: rank 1 failed first: ..." in one line instead of a traceback that names
the innocent plugin. The store may be gone with the failed rank (rank 0 serves
it): then the line says that another rank failed or was lost.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import time
import traceback
from typing import Optional

import torch.distributed as dist

FIRST_FAILURE = "ddpx/first_failure"
REPORTED_ON_NODE = "ddpx/reported/node"  # + GROUP_RANK: the rank that prints its node's failure
# What gloo, NCCL and the store say when the other end of a collective went away or hung.
PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|Timed out waiting|"
                       r"timed out|Socket Timeout|NCCL communicator was aborted|ECONNRESET", re.IGNORECASE)
PEER_ADDRESS = re.compile(r"\[([0-9a-fA-F.:]+)\]:\d+")  # gloo: "Read error [10.0.0.2]:40123: ...", "peer [...]:..."
CXX_LOCATION = re.compile(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\] ")  # "[.../unbound_buffer.cc:78] " before gloo's words
STORE_WAIT_S = 3.0  # for the failed rank's line to reach the store


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` broke a collective or the store because another rank failed, died or hung."""
    if isinstance(exc, (dist.DistNetworkError, dist.DistStoreError)):
        return True
    return isinstance(exc, RuntimeError) and PEER_GONE.search(str(exc)) is not None


def summary(exc: BaseException, limit: int = 160) -> str:
    """``Type: first line`` of an error, cut to ``limit`` characters."""
    first = CXX_LOCATION.sub("", (str(exc).strip().splitlines() or [""])[0])
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


@contextlib.contextmanager
def short_timeout(store):
    """A failing run must not wait on the store for long; the plugins' exception hooks after us
    (a final checkpoint) get its usual timeout back."""
    before = store.timeout
    store.set_timeout(datetime.timedelta(seconds=STORE_WAIT_S))
    try:
        yield store
    finally:
        store.set_timeout(before)


def record_first_failure(store, rank: int, exc: BaseException, where: str = "") -> None:
    """File this rank's error as the run's first failure, unless another rank's came first;
    ``where``: the rank's place in the model (a pipeline stage), shown after its number."""
    if store is None:
        return
    try:
        with short_timeout(store):
            store.compare_set(FIRST_FAILURE, "", f"{rank}\t{where}\t{summary(exc)}")
    except Exception:  # the store is gone: the launcher still names the first rank to exit
        pass


def first_failure(store, wait_s: float = STORE_WAIT_S) -> Optional[tuple[int, str, str]]:
    """``(rank, its place in the model or "", error)`` of the first rank that failed on its own, or None when none said so in time."""
    if store is None:
        return None
    deadline = time.monotonic() + wait_s
    try:
        with short_timeout(store):
            while True:
                if store.check([FIRST_FAILURE]):
                    rank, where, text = store.get(FIRST_FAILURE).decode().split("\t", 2)
                    return int(rank), where, text
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.1)
    except Exception:  # the store went with the failed rank
        return None


def peer_failure_line(exc: BaseException, store, step: int) -> str:
    """What a rank whose collective broke prints instead of a traceback."""
    first = first_failure(store)
    if first is not None:
        rank, where, error = first
        return f"stopped at step {step}: rank {rank}{f' ({where})' if where else ''} failed first: {error}"
    found = PEER_ADDRESS.search(str(exc))
    why = f"the connection to {found.group(1)} broke" if found else summary(exc, limit=100)
    return (f"stopped at step {step}: another rank failed, hung or lost its host ({why}); "
            f"the output of that rank or host says why")


def claim_report(store) -> bool:
    """Whether this rank prints its failure: the first rank of its node (GROUP_RANK) to ask does,
    the others stay silent, so a node shows one line, not one per rank. True when the store
    cannot tell (no process group yet, or it went with a failed rank)."""
    if store is None:
        return True
    me = os.environ.get("RANK", "0")
    try:
        with short_timeout(store):
            return store.compare_set(REPORTED_ON_NODE + os.environ.get("GROUP_RANK", "0"), "", me) == me.encode()
    except Exception:
        return True


def where_raised(exc: BaseException) -> str:
    """``file.py:LINE`` of the innermost frame that raised ``exc``, or ""."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""


def failure_line(exc: BaseException, peer_failure: Optional[str] = None) -> tuple[str, bool]:
    """The one line a rank prints for the error that ended its run, and whether an unexpected
    error's traceback should come with it (not for bad input, a plugin's own error, or a rank
    stopped by another's failure: their line says all a user needs)."""
    from ..errors import DdpxError, TrainingDiverged
    from ..plugin.manager import TRAINER_PLUGIN, origin

    if peer_failure is not None:
        return peer_failure, False
    if isinstance(exc, DdpxError):
        return f"{'training diverged: ' if isinstance(exc, TrainingDiverged) else ''}{exc}", False
    at = where_raised(exc)
    where = origin(exc)
    if where is not None and where[0] != TRAINER_PLUGIN:  # the trainer's own hooks run the user's model: show where
        return f"plugin '{where[0]}' raised in {where[1]}: {summary(exc, limit=400)} ({at})", False
    return f"{summary(exc, limit=400)} ({at})", True

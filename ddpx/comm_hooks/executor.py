"""The FIFO executor thread of the multi-phase comm hooks.

Collective order. Summable formats (allreduce, fp16, bf16) issue their
collectives directly in the hook: DDP calls hooks in bucket order on every
rank. Multi-phase formats (int8, onebit, powersgd) issue collectives that
depend on earlier results; doing that in future callbacks would issue them in
whatever order the network finishes (the bug behind torch's powerSGD crash on
gloo). They run on one FIFO executor thread per state instead, so every rank
issues every collective in bucket order, with several buckets queued at once
and backward computation overlapping the communication. The executor uses its
own process group (``executor_group``, a private copy of the hook's group made
at the same point on every rank): DDP itself issues collectives on the main
group while buckets are still in flight (e.g. the unused-parameter map with
``find_unused_parameters=True``), and two threads sharing one group would
interleave differently on different ranks.
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Callable

import torch
import torch.distributed as dist

from ..errors import DdpxError


# How often an idle executor thread checks that its process group still exists
# (one wake-up per interval while idle, nothing per step).
IDLE_CHECK_S = 1.0
# How long close() waits for a job in progress to end.
CLOSE_TIMEOUT_S = 30.0


class SerialExecutor:
    """A FIFO executor thread: jobs run one after another, in submission order.

    ``submit(fn, device)`` returns a torch Future completed with ``fn()``'s
    result (or its exception). ``submit_deferred(fn, device)`` calls
    ``fn(fut)``, which completes the future itself, possibly from a later job
    (software pipelining across buckets). One thread runs every job of a state,
    so collectives are issued in the order DDP hands buckets over -- the same
    on every rank.

    The thread (named ``name``) ends when the executor is closed (``close()``,
    also when the executor is garbage-collected with its hook state) and when,
    idle, it finds ``group`` destroyed; a later submit after that starts a new one.
    """

    def __init__(self, name: str, group=None):
        self._jobs = _JobQueue(name, group)
        # the queue, not the executor, runs the thread: so the thread does not keep
        # the executor (and the hook state owning it) alive
        self._finalizer = weakref.finalize(self, self._jobs.close)
        self._finalizer.atexit = False  # at exit the daemon thread just ends: no wait for a stuck job

    def submit(self, fn: Callable[[], torch.Tensor], device: torch.device) -> torch.futures.Future:
        return self._put(lambda fut: fut.set_result(fn()), device)

    def submit_deferred(self, fn: Callable[[torch.futures.Future], None], device: torch.device):
        return self._put(fn, device)

    def close(self) -> None:
        """Run the jobs already queued, end the thread and wait for it; no job is accepted after."""
        self._finalizer()

    def _put(self, fn, device):
        fut = torch.futures.Future(devices=[device] if device.type == "cuda" else None)
        ready = None
        if device.type == "cuda":  # the bucket was produced on the caller's stream
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        self._jobs.put((fn, fut, ready, device))
        return fut


class _JobQueue:
    """A SerialExecutor's jobs and the thread that runs them."""

    def __init__(self, name: str, group):
        self.name = name
        self.group = group
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.closed = False
        # one side stream for every job, also across thread restarts: torch keeps a
        # cuBLAS workspace per (handle, stream), 32 MiB each on sm90
        self.stream = None

    def put(self, job) -> None:
        with self.lock:
            if self.closed:
                raise DdpxError(f"{self.name}: this comm hook state was closed; make a new one with "
                                "ddpx.comm_hooks.make() or ddpx.comm_hooks.register()")
            if self.thread is None:
                self.thread = threading.Thread(target=self.run, name=self.name, daemon=True)
                self.thread.start()
            self.jobs.put(job)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            thread, self.thread = self.thread, None
            if thread is None:
                return
            self.jobs.put(None)  # after the jobs already queued
        if thread is not threading.current_thread():  # a finalizer may run on the thread itself
            thread.join(CLOSE_TIMEOUT_S)

    def group_alive(self) -> bool:
        if not dist.is_initialized():
            return False
        try:
            dist.get_backend(self.group)  # raises once the group is destroyed
        except (ValueError, RuntimeError, TypeError):  # torch 2.7: TypeError ("value was None")
            return False
        return True

    def run(self) -> None:
        while True:
            try:
                job = self.jobs.get(timeout=IDLE_CHECK_S)
            except queue.Empty:
                if self.group_alive():
                    continue
                with self.lock:
                    if self.jobs.empty():  # else a job arrived meanwhile: run it
                        self.thread = None
                        return
                continue
            if job is None:
                return
            fn, fut, ready, device = job
            del job  # a finished job must not keep its hook state alive (see the finally)
            try:
                if ready is None:
                    fn(fut)
                    continue
                if self.stream is None:
                    self.stream = torch.cuda.Stream(device)
                with torch.cuda.device(device), torch.cuda.stream(self.stream):
                    self.stream.wait_event(ready)
                    fn(fut)  # completing a future records readiness on this stream
            except BaseException as exc:  # surfaces in loss.backward() on this rank
                if not fut.done():
                    fut.set_exception(exc)
            finally:
                del fn, fut, ready

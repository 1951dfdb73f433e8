"""SIGTERM/SIGINT/SIGHUP during a run: the trainer's handlers, and the agreement that stops every
rank after the same step.

The trainer is the one owner of SIGTERM/SIGINT/SIGHUP during a run (:class:`StopSignals`): it
installs the handlers in ``setup()``, before any plugin's, and restores the previous ones
in ``close()``. A rank cannot stop alone: its peers would wait for it in their next
collective. So a stop must be agreed on (:class:`StopAgreement`). A plugin that acts on a
stop (the checkpoint plugin: a final checkpoint) turns it on with
``trainer.agree_on_stops(...)`` from its ``ddpx_setup`` and asks
:meth:`StopAgreement.check` at the step boundaries it schedules; without one, the trainer
stops a rank at once (:class:`TrainingStopped`: teardown, a clear message, exit 128 + the
signal number).

SIGHUP (the terminal closed, the ssh connection dropped: torchrun forwards it to the
workers) stops a run as the other two do, unless it is ignored when the run starts (``nohup``):
then it stays ignored.

How the ranks agree: the first SIGTERM, SIGINT or SIGHUP only sets a flag (and the
trainer restores the default handlers, so a second one acts at once). At each
stop check (every ``every_steps`` optimizer steps, or with 0 about every
``every_s`` seconds) each rank reads the all_reduce (MAX) of the flags it
started at the previous check and starts the next one asynchronously, so no
rank waits for the others; all of them stop after the same step. The checks
fall on the same ``global_step`` on every rank: the interval is taken from the
slowest rank's step time, which travels in the same all_reduce, as does
whether a rank's loss was non-finite since its previous check (see
``trainer.nonfinite_loss``) and whether a rank's stream without ``__len__`` ran out
(:attr:`StopAgreement.data_ended`: the epoch then ends on every rank at the check that
reads it, :mod:`ddpx.train.stream_end`). A signal takes effect within two intervals.
``torchrun`` also SIGTERMs the survivors when a rank fails; those make no
progress, so a rank that reaches no step boundary for ``timeout_s`` after the
signal terminates at once (:meth:`StopAgreement.arm_stop_deadline`).
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from ..console import write_fd

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
FIRST_STOP_CHECK = 10  # optimizer steps to the first stop check (auto), before any step time is known
MAX_STOP_CHECK = 1000  # auto never checks less often than this
STREAM_STOP_CHECK = 10  # ... or than this over a stream without __len__: its end comes within two checks


class TrainingStopped(Exception):
    """Raised when SIGTERM/SIGINT/SIGHUP asked the run to stop: at a batch boundary every
    rank agreed on (a plugin turned on the stop agreement: ``trainer.agree_on_stops``), or at once."""

    def __init__(self, signum: int, detail: str = ""):
        super().__init__(f"stopped by signal {signal.Signals(signum).name}{detail}")
        self.signum = signum


class StopSignals:
    """The trainer's SIGTERM/SIGINT/SIGHUP handlers for one run: :meth:`install` in setup,
    :meth:`restore` in close. A signal goes to the stop agreement while it takes signals;
    otherwise the rank stops at once."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.previous: dict = {}
        self.pid = os.getpid()

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only
        self.pid = os.getpid()
        for sig in STOP_SIGNALS:
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # nohup: the run outlives its terminal
            self.previous[sig] = signal.signal(sig, self.on_signal)

    def on_signal(self, signum, frame) -> None:
        if os.getpid() != self.pid:
            # A DataLoader worker forked with this handler (Ctrl-C reaches the terminal's whole process
            # group): the rank decides and shuts its workers down; SIGTERM ends a worker as it would anyway.
            if signum != signal.SIGINT:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        # A second signal acts immediately (KeyboardInterrupt / termination).
        for sig in self.previous:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        agreement = self.trainer.stop_agreement
        if agreement is not None and agreement.taking_signals:
            agreement.on_signal(signum)
            return
        raise TrainingStopped(signum, ": no plugin agrees on a stop across ranks (checkpoint plugin "
                              "blocked or not set up), exiting at once without a final checkpoint")

    def restore(self) -> None:
        handlers, self.previous = self.previous, {}
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def across_ranks(trainer) -> bool:
    """Whether there are other ranks to agree with."""
    return dist.is_available() and dist.is_initialized() and trainer.world_size > 1


class StopAgreement:
    """One run's stop agreement (``trainer.stop_agreement``).

    ``every_steps``: a stop check every N optimizer steps (0: about every
    ``every_s`` seconds); ``timeout_s``: how long a rank waits for a step
    boundary after a signal before it exits without agreeing (``timeout_key``:
    the config key that sets it, for the message); ``what``: what the agreed
    stop brings (``"a final checkpoint"``), for the messages.
    """

    def __init__(self, trainer, every_steps: int, every_s: float, timeout_s: float,
                 timeout_key: str = "timeout_s", what: str = "an agreed stop"):
        self.trainer = trainer
        self.every_steps, self.every_s, self.timeout_s = every_steps, every_s, timeout_s
        self.timeout_key, self.what = timeout_key, what
        self.signal_received = 0
        self.losses = None  # the trainer's LossWindow since the last stop check (opened at start())
        self.losses_from = 0  # optimizer step at which that window starts
        self.stop_deadline: Optional[threading.Event] = None  # set() ends the watchdog of a stop
        self.stop_vote = None  # (work, tensor, steps it covers) of the all_reduce started at the last check
        self.taking_signals = True  # the trainer hands its stop signals to on_signal until release()
        self.data_ended = False  # this rank's stream (no __len__) ran out in this epoch: voted at the next check
        self.most_steps = MAX_STOP_CHECK  # the longest auto interval (set by the trainer, the same on every rank)
        self.start_checks(0)

    # --- the signal --------------------------------------------------------------------

    def on_signal(self, signum: int) -> None:
        """The trainer's handler calls this instead of stopping at once."""
        self.signal_received = signum
        # not print/logging: a signal may interrupt a write to stderr
        within = f"{2 * self.every_steps} optimizer steps" if self.every_steps else f"about {2 * self.every_s:g} s"
        write_fd(2, (f"[rank{self.trainer.rank}] ddpx: received {signal.Signals(signum).name}: stopping within "
                     f"{within} with {self.what} (send it again to exit now)\n").encode())
        self.arm_stop_deadline()

    def give_up(self, signum: int) -> None:
        write_fd(2, (
            f"[rank{self.trainer.rank}] ddpx: no optimizer step boundary for {self.timeout_key}={self.timeout_s:g} s "
            f"after {signal.Signals(signum).name} (a peer failed or hangs): exiting without {self.what}\n"
        ).encode())
        os.kill(os.getpid(), signal.SIGTERM)  # its default action since the first signal

    def arm_stop_deadline(self) -> None:
        """(Re)start the watchdog: it gives up once ``global_step`` has not moved for
        ``timeout_s`` (read from its own thread: the loop does nothing per step for it)."""
        self.stop_agreed()
        trainer, timeout, signum = self.trainer, self.timeout_s, self.signal_received
        ended = self.stop_deadline = threading.Event()

        def watch():
            step, since = trainer.global_step, time.monotonic()
            while not ended.wait(min(1.0, timeout / 10)):
                if trainer.global_step != step:
                    step, since = trainer.global_step, time.monotonic()
                elif time.monotonic() - since >= timeout:
                    self.give_up(signum)
                    return

        threading.Thread(target=watch, name="ddpx-stop-deadline", daemon=True).start()

    def stop_agreed(self) -> None:
        if self.stop_deadline is not None:
            self.stop_deadline.set()
            self.stop_deadline = None

    # --- the checks ----------------------------------------------------------------------

    def interval(self, slowest_step_s: Optional[float]) -> int:
        """Optimizer steps to the next stop check: the same on every rank (it
        depends only on the config and the all-reduced step time)."""
        if self.every_steps:
            return self.every_steps
        if slowest_step_s is None:
            return min(FIRST_STOP_CHECK, self.most_steps)
        return max(1, min(self.most_steps, int(self.every_s / max(slowest_step_s, 1e-9))))

    def start_checks(self, step: int) -> None:
        self.check_step, self.check_time = step, time.perf_counter()
        self.next_check = step + self.interval(None)

    def start(self, trainer) -> None:
        """Training starts (after a resume): the checks and the loss window start here."""
        self.losses, self.losses_from = trainer.open_loss_window(), trainer.global_step
        self.start_checks(trainer.global_step)

    def collect_vote(self):
        """Wait for the all_reduce in flight (if any): (did any rank vote to stop,
        the slowest rank's seconds per step or None, the steps ``(first, last)`` in
        which some rank's loss was non-finite, or None, did some rank's stream run out)."""
        vote, self.stop_vote = self.stop_vote, None
        if vote is None:
            return False, None, None, False
        work, tensor, steps = vote
        work.wait()
        flag, slowest_step_s, nonfinite, data_ended = tensor.tolist()
        return flag > 0, slowest_step_s, steps if nonfinite > 0 else None, data_ended > 0

    def take_losses(self, trainer):
        """The sum of the losses since the previous call (a float64 device tensor,
        no host sync; None if there were none) and the steps ``(first, last)`` it covers."""
        loss_sum, _ = self.losses.take() if self.losses is not None else (None, 0)
        steps, self.losses_from = (self.losses_from + 1, trainer.global_step), trainer.global_step
        return loss_sum, steps

    def check(self, trainer) -> bool:
        """True on every rank, at the same boundary, once any rank received a stop
        signal. Call it at optimizer-step boundaries (``trainer.call_at_step``);
        it does something only from ``next_check`` on."""
        step = trainer.global_step
        if step < self.next_check:
            return False
        flag = 1.0 if self.signal_received else 0.0
        now = time.perf_counter()
        step_s = (now - self.check_time) / max(1, step - self.check_step)
        self.check_time, self.check_step = now, step
        loss_sum, steps = self.take_losses(trainer)
        if not across_ranks(trainer):  # no one to agree with
            self.next_check = step + self.interval(step_s)
            if loss_sum is not None and not math.isfinite(loss_sum.item()):
                _nonfinite_loss(trainer, steps)
            return bool(flag)
        agreed, slowest_step_s, nonfinite_steps, data_ended = self.collect_vote()
        if agreed:
            return True
        if nonfinite_steps is not None:
            _nonfinite_loss(trainer, nonfinite_steps)
        if data_ended:  # every rank reads it here: the epoch ends at this step, the next vote is the next epoch's
            self.data_ended = False
            trainer.num_batches = trainer.epoch_batches
        self.next_check = step + self.interval(slowest_step_s)
        nonfinite = 0.0 if loss_sum is None else (~torch.isfinite(loss_sum)).double()
        tensor = torch.tensor([flag, step_s, 0.0, float(self.data_ended)], dtype=torch.float64,
                              device=trainer.device)
        tensor[2] = nonfinite  # a device tensor copied on the device: no host sync
        self.stop_vote = (dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True), tensor, steps)
        return False

    def finish(self) -> None:
        """Training ended normally: finish the all_reduce every rank started (before
        the process group goes), then stop taking signals."""
        self.collect_vote()
        self.release()

    def release(self) -> None:
        """Back to the trainer's own handling (stop at once) for the rest of the run.
        No collective: after a failure the other ranks may be gone."""
        self.stop_agreed()
        self.taking_signals = False


def _nonfinite_loss(trainer, steps) -> None:
    if trainer.scaler.is_enabled():
        return  # fp16 AMP: the GradScaler skipped those steps; the trainer reports a scale that collapses
    first, last = steps
    trainer.nonfinite_loss(f"between optimizer steps {first} and {last} (epoch {trainer.epoch})")

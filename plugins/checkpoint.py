"""Checkpoints, exact resume after a restart, and a clean stop on SIGTERM/SIGINT.

Saving. Every ``every_steps`` optimizer steps (0: never mid-epoch), at every
epoch end, when a stop is requested and when training ends, all ranks take part
in one save, always at an optimizer-step boundary (never inside an
accumulation window). The content is every plugin's ``ddpx_state_dict``
(``trainer.state_dict()``: the core's model, optimizer, scheduler and
progress -- step and epoch --, the sampler position, the GradScaler, the
comm-hook state, ...) plus each rank's RNG states. The core's entries
(``model``, ``optimizer``, ``scheduler``, ``progress``) are identical on every
rank under DDP and are taken from rank 0; every other entry and the RNG
states are per rank and reach rank 0 through one ``gather_object`` (same order
on every rank). Rank 0 writes ``<run_dir>/<dir>/step-N.pt`` atomically (see
:mod:`ddpx.checkpoint`), keeping the newest ``keep``. With
``async_write`` the training loop waits only for a copy of the state to CPU
memory; serialization and fsync run on a background thread, one write at a
time, and the run waits for the last one before it exits.

Resuming. With ``resume`` (the default), the run starts from the newest
checkpoint in that directory that loads completely (rank 0 chooses it, every
rank reads the same file, so the directory must be on a file system all nodes
see). Restored through ``trainer.load_state_dict``: model, optimizer,
scheduler, step, epoch, every plugin's state (the sampler skips the samples
the checkpoint already trained on, without loading them) and, when the world
size is unchanged, each rank's own per-rank entries and RNG states.

A different world size on resume (``--nnodes MIN:MAX``, fewer GPUs):

* the sampler re-divides the rest of the interrupted epoch among the new ranks
  (every sample of the epoch is still used exactly once);
* ``trainer.batch_size`` stays the per-rank batch, so the global batch becomes
  ``new_world_size * batch_size * accumulation.steps``;
* the learning rate is unchanged (``lr_scaling: none``) or multiplied by
  ``new_world_size / old_world_size`` (``lr_scaling: linear``: the optimizer's
  ``lr`` and ``initial_lr`` and the scheduler's ``base_lrs``);
* RNG states are not restored (they are per rank): every rank keeps the
  seeding of the fresh start, with a warning;
* per-rank plugin state (comm-hook error feedback) receives rank 0's entries,
  which the plugin resets with a warning (its state records its rank and world size).

Stopping. The trainer owns the SIGTERM/SIGINT handlers; from ``ddpx_setup``
on, this plugin takes the signals through ``trainer.stop_signal_handler``: the
first SIGTERM or SIGINT only sets a flag (the trainer restores the default
handlers, so a second one acts at once).
At each stop check (every ``stop_check_every`` optimizer steps, or with 0
about every ``stop_check_s`` seconds, see :func:`_agree_to_stop`) the ranks
combine their flags with one asynchronous ``all_reduce`` (MAX), read at the
next check (so no rank waits for the others), and all of them stop after the
same step: they write a
final checkpoint and call ``trainer.request_stop``; the loop ends at that
boundary and the worker exits with 128 + the signal number once the write is
on disk. ``torchrun`` forwards a SIGTERM/SIGINT it receives to every worker
and kills them 30 s later. It also SIGTERMs the survivors when a rank fails;
those make no progress, so a rank that reaches no step boundary for
``stop_timeout_s`` after the signal terminates at once, without a final
checkpoint (the last periodic one is used on restart).

Config section ``checkpoint``: ``enabled`` (true), ``every_steps`` (0),
``keep`` (3), ``dir`` (``checkpoints``, relative to ``run_dir``), ``resume``
(true), ``async_write`` (true), ``lr_scaling`` (``none`` | ``linear``),
``stop_timeout_s`` (20), ``stop_check_every`` (0: auto), ``stop_check_s`` (1.0).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from ddpx import hookimpl
from ddpx.errors import DdpxError

LR_SCALING = ("none", "linear")
FIRST_STOP_CHECK = 10  # optimizer steps to the first stop check (auto), before any step time is known
MAX_STOP_CHECK = 1000  # auto never checks less often than this


class CheckpointSession:
    """Per-run state: the writer, the last saved step, the signal flag."""

    def __init__(self, trainer, cfg):
        from ddpx.checkpoint import AsyncCheckpointWriter, CheckpointDirectory

        self.cfg = cfg
        self.enabled = cfg["enabled"]
        directory = Path(cfg["dir"])
        if not directory.is_absolute():
            directory = Path(trainer.run_dir) / directory
        self.directory = CheckpointDirectory(directory, keep=cfg["keep"])
        self.writer = AsyncCheckpointWriter(self.directory, async_write=cfg["async_write"])
        self.saved = None  # (step, at_epoch_end) of the last save or of the resumed checkpoint
        self.signal_received = 0
        self.trainer = None  # whose stop signals this session takes
        self.stop_deadline = None  # Event: set() ends the watchdog of a stop no step boundary completes
        self.stop_vote = None  # (work, tensor) of the all_reduce started at the last stop check
        self.start_stop_checks(0)

    # --- signals ------------------------------------------------------------------------

    def take_stop_signals(self, trainer):
        """Handle SIGTERM/SIGINT for the trainer, which owns the handlers (see
        ddpx/trainer.py): it calls us instead of stopping at once, and resets
        the handlers so a second signal acts immediately."""
        rank = trainer.rank
        timeout = self.cfg["stop_timeout_s"]

        def on_signal(signum):
            self.signal_received = signum
            # os.write, not print/logging: a signal may interrupt a write to stderr
            every = self.cfg["stop_check_every"]
            within = f"{2 * every} optimizer steps" if every else f"about {2 * self.cfg['stop_check_s']:g} s"
            os.write(2, (
                f"[rank{rank}] ddpx: received {signal.Signals(signum).name}: stopping within {within} "
                "with a final checkpoint "
                "(send it again to exit now)\n"
            ).encode())
            self.arm_stop_deadline()

        def give_up(signum):
            os.write(2, (
                f"[rank{rank}] ddpx: no optimizer step boundary for checkpoint.stop_timeout_s="
                f"{timeout:g} s after {signal.Signals(signum).name} (a peer failed or hangs): "
                "exiting without a final checkpoint\n"
            ).encode())
            os.kill(os.getpid(), signal.SIGTERM)  # its default action since the first signal

        self.give_up = give_up
        self.trainer = trainer
        trainer.stop_signal_handler = on_signal

    def arm_stop_deadline(self):
        """(Re)start the watchdog: torchrun also SIGTERMs the survivors of a failed
        rank; they make no progress, so do not let them wait for torchrun's SIGKILL.
        It gives up once ``global_step`` has not moved for ``stop_timeout_s``
        (read from its own thread: the loop does nothing per step for it)."""
        self.stop_agreed()
        trainer, timeout, signum = self.trainer, self.cfg["stop_timeout_s"], self.signal_received
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

    def stop_agreed(self):
        if self.stop_deadline is not None:
            self.stop_deadline.set()
            self.stop_deadline = None

    def collect_stop_vote(self):
        """Wait for the stop all_reduce in flight (if any): (did any rank vote to
        stop, the slowest rank's seconds per step or None)."""
        vote, self.stop_vote = self.stop_vote, None
        if vote is None:
            return False, None
        work, tensor = vote
        work.wait()
        flag, slowest_step_s = tensor.tolist()
        return flag > 0, slowest_step_s

    def stop_check_interval(self, slowest_step_s) -> int:
        """Optimizer steps to the next stop check: the same on every rank (it
        depends only on the config and the all-reduced step time)."""
        every = self.cfg["stop_check_every"]
        if every:
            return every
        if slowest_step_s is None:
            return FIRST_STOP_CHECK
        return max(1, min(MAX_STOP_CHECK, int(self.cfg["stop_check_s"] / max(slowest_step_s, 1e-9))))

    def start_stop_checks(self, step):
        self.stop_check_step, self.stop_check_time = step, time.perf_counter()
        self.next_stop_check = step + self.stop_check_interval(None)

    def schedule(self, trainer):
        """Be called at the next stop check or periodic save, whichever comes first
        (the same step on every rank: both depend on the config, global_step
        and the all-reduced step time only)."""
        due = self.next_stop_check
        every = self.cfg["every_steps"]
        if every:
            due = min(due, (trainer.global_step // every + 1) * every)
        trainer.call_at_step(due, self.at_step)

    def at_step(self, trainer):
        """A stop check and/or a periodic save, at an optimizer-step boundary (also
        one whose step AMP skipped: the core counts both in global_step)."""
        stop = _agree_to_stop(trainer, self)
        self.schedule(trainer)  # after the check: it moves next_stop_check
        if stop:
            self.stop_agreed()  # the final save is bounded by trainer.timeout_s
        every = self.cfg["every_steps"]
        # The epoch's last step is saved by the epoch end (which also runs the evaluation).
        periodic = every and trainer.global_step % every == 0 and not _epoch_exhausted(trainer)
        if self.enabled and (periodic or stop):
            _save(trainer, self, at_epoch_end=False)
        if stop:
            trainer.request_stop(self.signal_received or signal.SIGTERM)

    def release_stop_signals(self):
        """Back to the trainer's own handling (stop at once) for the rest of the run."""
        self.stop_agreed()
        trainer, self.trainer = self.trainer, None
        if trainer is not None:
            trainer.stop_signal_handler = None


_session: CheckpointSession | None = None


def _world(trainer):
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and trainer.world_size > 1


@hookimpl
def ddpx_config_defaults():
    return {
        "checkpoint": {
            "enabled": True,
            "every_steps": 0,
            "keep": 3,
            "dir": "checkpoints",
            "resume": True,
            "async_write": True,
            "lr_scaling": "none",
            "stop_timeout_s": 20.0,
            "stop_check_every": 0,
            "stop_check_s": 1.0,
        }
    }


@hookimpl
def ddpx_configure(config):
    cfg = config.section("checkpoint")
    if cfg["every_steps"] < 0:
        raise DdpxError(f"checkpoint.every_steps must be >= 0 (0: only at epoch ends), got {cfg['every_steps']}")
    if cfg["keep"] < 1:
        raise DdpxError(f"checkpoint.keep must be >= 1, got {cfg['keep']}")
    if cfg["stop_check_every"] < 0:
        raise DdpxError(f"checkpoint.stop_check_every must be >= 0 (0: about every stop_check_s seconds), "
                        f"got {cfg['stop_check_every']}")
    if cfg["stop_check_s"] <= 0:
        raise DdpxError(f"checkpoint.stop_check_s must be > 0, got {cfg['stop_check_s']}")
    if cfg["stop_timeout_s"] <= 0:
        raise DdpxError(f"checkpoint.stop_timeout_s must be > 0, got {cfg['stop_timeout_s']}")
    if cfg["lr_scaling"] not in LR_SCALING:
        raise DdpxError(f"checkpoint.lr_scaling must be one of {', '.join(LR_SCALING)}, got {cfg['lr_scaling']!r}")


@hookimpl
def ddpx_setup(trainer):
    global _session
    _session = CheckpointSession(trainer, trainer.config.section("checkpoint"))
    _session.take_stop_signals(trainer)


@hookimpl(tryfirst=True)  # restore before other plugins see the start of training
def ddpx_train_start(trainer):
    if _session is None:
        return
    if _session.enabled and _session.cfg["resume"]:
        _resume(trainer, _session)
    _session.start_stop_checks(trainer.global_step)
    _session.schedule(trainer)


@hookimpl(trylast=True)
def ddpx_epoch_end(trainer, epoch, metrics):
    if _session is not None and _session.enabled:
        _save(trainer, _session, at_epoch_end=True)


@hookimpl(trylast=True)
def ddpx_train_end(trainer):
    session = _session
    if session is None:
        return
    try:
        if session.enabled and (session.saved or (None,))[0] != trainer.global_step:
            _save(trainer, session, at_epoch_end=False)  # e.g. stopped by trainer.max_steps
        session.writer.wait()
        session.collect_stop_vote()  # every rank started it: finish it before the group goes
    finally:
        session.release_stop_signals()


@hookimpl
def ddpx_exception(trainer, exc):
    # No collective here: the other ranks may be gone. Finish the write in flight
    # (it is a complete, consistent checkpoint) and leave.
    session = _session
    if session is None:
        return
    session.release_stop_signals()
    try:
        session.writer.wait()
    except Exception as error:
        trainer.log.warning(f"the last checkpoint write failed too: {error}")


# --- collective parts (every rank, same order) -------------------------------------------

# Entries of the core plugin's state: replicated by DDP, so taken from rank 0 only.
REPLICATED = ("model", "optimizer", "scheduler", "progress")


def _agree_to_stop(trainer, session) -> bool:
    """True on every rank, at the same boundary, once any rank received a stop signal.

    At each check each rank reads the all_reduce (MAX) of the flags it started
    at the previous check and starts the next one asynchronously, so no rank
    waits for the others. The checks fall on the same ``global_step`` on every
    rank: every ``stop_check_every`` optimizer steps, or with 0 (auto) about
    every ``stop_check_s`` seconds, the interval taken from the slowest rank's
    step time, which travels in the same all_reduce. A signal takes effect
    within two intervals.
    """
    step = trainer.global_step
    if step < session.next_stop_check:
        return False
    flag = 1.0 if session.signal_received else 0.0
    now = time.perf_counter()
    step_s = (now - session.stop_check_time) / max(1, step - session.stop_check_step)
    session.stop_check_time, session.stop_check_step = now, step
    if not _world(trainer):  # no one to agree with
        session.next_stop_check = step + session.stop_check_interval(step_s)
        return bool(flag)
    import torch
    import torch.distributed as dist

    agreed, slowest_step_s = session.collect_stop_vote()
    if agreed:
        return True
    session.next_stop_check = step + session.stop_check_interval(slowest_step_s)
    tensor = torch.tensor([flag, step_s], dtype=torch.float64, device=trainer.device)
    session.stop_vote = (dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True), tensor)
    return False


def _epoch_exhausted(trainer) -> bool:
    """The step just taken was the epoch's last."""
    return trainer.epoch_batches >= trainer.num_batches


def _save(trainer, session, at_epoch_end):
    from ddpx.checkpoint import rng_state

    step = trainer.global_step
    if session.saved == (step, at_epoch_end):  # same on every rank: all skip the collective
        return
    session.saved = (step, at_epoch_end)
    state = trainer.state_dict()
    mine = {
        "rng": rng_state(trainer.device),
        "plugins": {k: v for k, v in state.items() if k not in REPLICATED},
    }
    if _world(trainer):
        import torch.distributed as dist

        gathered = [None] * trainer.world_size if trainer.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
    else:
        gathered = [mine]
    if trainer.rank != 0:
        return
    checkpoint = {
        "step": step,
        "world_size": trainer.world_size,
        "replicated": {k: v for k, v in state.items() if k in REPLICATED},
        "ranks": gathered,
    }
    progress = state.get("progress", {})

    def done(path):
        trainer.log.info(f"saved checkpoint {path} (epoch {progress.get('epoch')}, step {step})")

    session.writer.save(checkpoint, step, on_done=done)


def _resume(trainer, session):
    import torch
    import torch.distributed as dist

    from ddpx.checkpoint import set_rng_state

    name = found = None
    if trainer.rank == 0:
        found = session.directory.load_latest()
        name = found[0].name if found else None
    if _world(trainer):
        box = [name]
        dist.broadcast_object_list(box, src=0)
        name = box[0]
    if name is None:
        return
    path = session.directory.directory / name
    error = None
    if found is not None:
        checkpoint = found[1]
    else:
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as exc:
            checkpoint, error = None, exc
    if _world(trainer):  # every rank must have the file before anyone changes course
        ok = torch.tensor([0 if checkpoint is None else 1], dtype=torch.int32, device=trainer.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not int(ok.item()):
            who = f"rank {trainer.rank} cannot read ({error})" if error else "another rank cannot read"
            raise DdpxError(
                f"{who} checkpoint {path} chosen by rank 0; put run_dir on a file system "
                "every node sees (or set checkpoint.resume=false)"
            )

    old_world, ranks = checkpoint["world_size"], checkpoint["ranks"]
    same_world = old_world == trainer.world_size
    mine = ranks[trainer.rank] if same_world else ranks[0]
    trainer.load_state_dict({**checkpoint["replicated"], **mine["plugins"]})
    session.saved = (trainer.global_step, None)
    if same_world:
        set_rng_state(mine["rng"], trainer.device)
    else:
        if trainer.rank == 0:
            trainer.log.warning(
                f"resuming with {trainer.world_size} ranks from a checkpoint of {old_world}: the rest "
                f"of epoch {trainer.epoch} is re-divided, the global batch is now {trainer.world_size} "
                "x the per-rank batch, RNG states are freshly seeded, the learning rate is "
                + ("scaled linearly" if session.cfg["lr_scaling"] == "linear" else "unchanged")
            )
        if session.cfg["lr_scaling"] == "linear":
            _scale_lr(trainer, trainer.world_size / old_world)
    trainer.log.info(f"resumed from {path} (epoch {trainer.epoch}, step {trainer.global_step})")


def _scale_lr(trainer, factor):
    for group in trainer.optimizer.param_groups:
        group["lr"] *= factor
        if "initial_lr" in group:
            group["initial_lr"] *= factor
    scheduler = getattr(trainer, "scheduler", None)
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
        if hasattr(scheduler, "_last_lr"):
            scheduler._last_lr = [group["lr"] for group in trainer.optimizer.param_groups]

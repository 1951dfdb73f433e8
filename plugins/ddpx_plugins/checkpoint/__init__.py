"""Checkpoints, exact resume after a restart, and a clean stop on SIGTERM/SIGINT/SIGHUP.

Saving. Every ``every_steps`` optimizer steps (0: never mid-epoch), at every
epoch end, when a stop is requested and when training ends, all ranks take part
in one save, always at an optimizer-step boundary (never inside an
accumulation window). The content is every plugin's ``ddpx_state_dict``
(``trainer.state_dict()``: the trainer's model, optimizer, scheduler and
progress -- step and epoch --, the sampler position, the GradScaler, the
comm-hook state, ...) plus each rank's RNG states. The trainer's entries
(``model``, ``optimizer``, ``scheduler``, ``progress``) are identical on every
rank under DDP and are taken from rank 0; every other entry and the RNG
states are per rank and reach rank 0 through one ``gather_object`` (same order
on every rank). Rank 0 writes ``<run_dir>/<dir>/step-N.pt`` atomically (see
:mod:`ddpx.rank.checkpoint_files`), keeping the newest ``keep``. With
``async_write`` the training loop waits only for a copy of the state to CPU
memory; serialization and fsync run on a background thread, one write at a
time, and the run waits for the last one before it exits.

Sharded state (``trainer.strategy: fsdp``). The model and optimizer entries are
each rank's shards, keyed by parameter name, and so is any plugin entry that holds
DTensors (the ema plugin's average): every rank writes its part of these with
``torch.distributed.checkpoint`` into ``step-N.shards/`` (first into a hidden
temporary directory, which rank 0 renames once every rank's files and the
metadata are complete), then ``step-N.pt`` is written as above, with everything
else, and names that directory; pruning removes the two together, and a file whose
directory is missing is skipped on resume. That part of the save is synchronous.
A resume reads the shards back through a reader that runs nothing stored in them
(the metadata is unpickled through an allow-list of DCP's plain records, other
entries are read with ``weights_only=True``), at the same or another world size.
At the end of training, under every strategy, rank 0 writes the trained model into
``run_dir/model/`` (the strategy's ``full_state_dict``, gathered under fsdp: every rank takes
part) through :func:`ddpx.rank.model_files.write_model`: ``model.safetensors`` (tied weights
once), with ``config.json`` for a HuggingFace model (a ``from_pretrained`` directory);
``ddpx export RUN_DIR`` writes the same from any checkpoint of a run.
A checkpoint saved under one strategy is not resumed under the other (one line says so).

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

Stopping. The trainer owns the SIGTERM/SIGINT/SIGHUP handlers and the agreement on a
stop (:mod:`ddpx.train.stopping`); this plugin turns the agreement on from
``ddpx_setup`` with its keys: a stop check every ``stop_check_every`` optimizer
steps, or with 0 about every ``stop_check_s`` seconds, where the ranks combine
their flags with one asynchronous ``all_reduce``, and all of them stop after the
same step: they write a final checkpoint and call ``trainer.request_stop``; the
loop ends at that boundary and the worker exits with 128 + the signal number
once the write is on disk. ``torchrun`` forwards a SIGTERM/SIGINT/SIGHUP it receives to
every worker and kills them 30 s later; a rank that reaches no step boundary for
``stop_timeout_s`` after the signal terminates at once, without a final
checkpoint (the last periodic one is used on restart).

Non-finite values (``trainer.nonfinite``). Each rank's micro-batch losses
since the previous stop check travel as a flag in the stop agreement's all_reduce, so
a non-finite loss is found within two stop checks at no extra collective or
host sync; the trainer then stops every rank (``stop``) or warns (``warn``).
Before every save one all_reduce checks that the weights, buffers and optimizer
state are finite on every rank; a non-finite state is never written (and so
never rotates a finite checkpoint away), whatever the policy. A resume skips a
checkpoint with non-finite weights (written by an older version). A run that
stopped because it diverged leaves ``diverged.json`` in the checkpoint
directory: an automatic restart of the same launch (``--max-restarts``), which
would resume the same checkpoint and diverge again, ends at once with the same
message instead; a new ``ddpx train`` (the config changed, say) removes it.

Best checkpoints. With ``monitor`` (an epoch metric: ``accuracy``,
``eval_loss``, ``loss``, ...) each epoch-end checkpoint is ranked by it
(``mode`` ``max``/``min``, ``auto``: ``min`` for names with "loss"); the best
``keep_best`` are kept besides the newest ``keep``, listed best first in
``best.json`` and the best one linked as ``best.pt``. Rank 0 logs the best one
when training ends (also for ``ddpx train`` on a run that already finished).

Config section ``checkpoint``: ``enabled`` (true), ``every_steps`` (0),
``keep`` (3), ``dir`` (``checkpoints``, relative to ``run_dir``), ``resume``
(true), ``async_write`` (true), ``lr_scaling`` (``none`` | ``linear``),
``stop_timeout_s`` (20), ``stop_check_every`` (0: auto), ``stop_check_s`` (1.0),
``monitor`` (null: none), ``mode`` (``auto`` | ``max`` | ``min``), ``keep_best`` (1).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
from pathlib import Path

from ddpx import hookimpl
from ddpx.errors import DdpxError, TrainingDiverged
from ddpx.plugin.shared import LAST_FINITE_CHECKPOINT
from ddpx.train.monitor import Monitor
from ddpx.train.state import TRAINER_STATE  # the trainer's own entries: one copy for all ranks

# What imports torch (ddpx.rank.checkpoint_files, ddpx.train.stopping, .finite, .resume) is
# imported in the functions that use it: loading the plugin (``ddpx plugins``, the launcher's
# config check) needs no torch.

LR_SCALING = ("none", "linear")
DIVERGED_MARKER = "diverged.json"  # written when training diverged; read by an automatic restart


class CheckpointSession:
    """What one run of the plugin holds (``trainer.plugin("checkpoint").session``): the
    directory and its writer, the last saved step, and the run's stop agreement (``stops``)."""

    def __init__(self, trainer, cfg):
        from ddpx.rank.checkpoint_files import AsyncCheckpointWriter, CheckpointDirectory

        self.cfg = cfg
        self.enabled = cfg["enabled"]
        directory = Path(cfg["dir"])
        if not directory.is_absolute():
            directory = Path(trainer.run_dir) / directory
        self.monitor = Monitor.from_config(cfg, "checkpoint")
        self.monitor_missing_warned = False
        self.directory = CheckpointDirectory(directory, keep=cfg["keep"], keep_best=cfg["keep_best"],
                                             mode=self.monitor.mode if self.monitor else "max")
        self.writer = AsyncCheckpointWriter(self.directory, async_write=cfg["async_write"])
        self.finite_at = 0  # the last step whose state was checked finite (a save or the resumed checkpoint)
        self.saved = None  # (step, at_epoch_end) of the last save or of the resumed checkpoint
        self.unannounced = None  # rank 0's "saved checkpoint" line of the last save, if not logged at info
        # The trainer's stop agreement (ddpx/train/stopping.py): SIGTERM/SIGINT/SIGHUP stop every rank
        # after the same step, with a final checkpoint written here.
        self.stops = trainer.agree_on_stops(cfg["stop_check_every"], cfg["stop_check_s"], cfg["stop_timeout_s"],
                                            "checkpoint.stop_timeout_s", "a final checkpoint")

    def schedule(self, trainer):
        """Be called at the next stop check or periodic save, whichever comes first
        (the same step on every rank: both depend on the config, global_step
        and the all-reduced step time only)."""
        due = self.stops.next_check
        every = self.cfg["every_steps"]
        if every:
            due = min(due, (trainer.global_step // every + 1) * every)
        trainer.call_at_step(due, self.at_step)

    def at_step(self, trainer):
        """A stop check and/or a periodic save, at an optimizer-step boundary (also
        one whose step AMP skipped: the trainer counts both in global_step)."""
        stop = self.stops.check(trainer)
        self.schedule(trainer)  # after the check: it moves the next check
        if stop:
            self.stops.stop_agreed()  # the final save is bounded by trainer.timeout_s
        every = self.cfg["every_steps"]
        # The epoch's last step is saved by the epoch end (which also runs the evaluation).
        periodic = every and trainer.global_step % every == 0 and not _epoch_exhausted(trainer)
        if self.enabled and (periodic or stop):
            _save(trainer, self, at_epoch_end=False, announce=stop)
        if stop:
            trainer.request_stop(self.stops.signal_received or signal.SIGTERM)


class CheckpointPlugin:
    """``session``: the run's :class:`CheckpointSession` (None before ``ddpx_setup``)."""

    def __init__(self):
        self.session = None

    @hookimpl
    def ddpx_config_defaults(self):
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
                "monitor": None,
                "mode": "auto",
                "keep_best": 1,
            }
        }

    @hookimpl
    def ddpx_configure(self, config):
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
        Monitor.from_config(cfg, "checkpoint")  # one-line errors for a bad name or mode
        if cfg["keep_best"] < 1:
            raise DdpxError(f"checkpoint.keep_best must be >= 1, got {cfg['keep_best']}")

    @hookimpl
    def ddpx_setup(self, trainer):
        self.session = CheckpointSession(trainer, trainer.config.section("checkpoint"))

    @hookimpl(tryfirst=True)  # restore before other plugins see the start of training
    def ddpx_train_start(self, trainer):
        session = self.session
        if session.enabled:
            _refuse_restart_after_divergence(trainer, session)
            if session.cfg["resume"]:
                from .resume import resume

                resume(trainer, session)
        session.stops.start(trainer)  # the checks count from the resumed step
        session.schedule(trainer)

    @hookimpl(trylast=True)
    def ddpx_epoch_end(self, trainer, epoch, metrics):
        if self.session.enabled:
            _save(trainer, self.session, at_epoch_end=True, metrics=metrics)

    @hookimpl(trylast=True)
    def ddpx_train_end(self, trainer):
        session = self.session
        _write_trained_model(trainer)
        if session.enabled and (session.saved or (None,))[0] != trainer.global_step:
            _save(trainer, session, at_epoch_end=False, announce=True)  # e.g. stopped by trainer.max_steps
        session.writer.wait()
        if session.unannounced and not trainer.log.isEnabledFor(logging.DEBUG):  # the run's last checkpoint is
            trainer.log.info(session.unannounced)  # said; each epoch end's only at logging.level=debug
        report_best(trainer, session)

    @hookimpl
    def ddpx_exception(self, trainer, exc):
        # No collective here: the other ranks may be gone. Finish the write in flight
        # (it is a complete, consistent checkpoint) and leave.
        session, self.session = self.session, None
        if session is None:  # ddpx_setup did not run
            return
        try:
            session.writer.wait()
        except Exception as error:
            trainer.log.warning(f"the last checkpoint write failed too: {error}")
        if isinstance(exc, TrainingDiverged) and session.enabled and trainer.rank == 0:
            _write_divergence_marker(trainer, session, exc)


# --- a run that diverged is not restarted automatically -------------------------------------


def _restart_count() -> int:
    """torchrun's restart count of this worker group (0 in a new launch)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    except ValueError:
        return 0


def _write_divergence_marker(trainer, session, exc) -> None:
    from ddpx.rank.checkpoint_files import atomic_write

    path = session.directory.directory / DIVERGED_MARKER
    try:  # a refused restart keeps the first divergence's message
        marker = {**json.loads(path.read_text()), "restart": _restart_count()}
    except (OSError, ValueError):
        marker = {"restart": _restart_count(), "step": trainer.global_step, "message": str(exc)}
    try:
        session.directory.directory.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: f.write(json.dumps(marker).encode()))
    except OSError as error:
        trainer.log.warning(f"cannot record the divergence in {session.directory.directory}: {error}")


def _refuse_restart_after_divergence(trainer, session) -> None:
    """An automatic restart (same launch, later restart count) of a run that
    diverged would resume the same checkpoint and diverge again: end it at once.
    A new launch removes the marker and trains (the user may have changed the
    config). Rank 0 decides; every rank raises."""
    from ddpx.train.stopping import across_ranks

    refusal = None
    if trainer.rank == 0:
        path = session.directory.directory / DIVERGED_MARKER
        try:
            marker = json.loads(path.read_text())
        except (OSError, ValueError):
            marker = None
        if marker is not None and _restart_count() > int(marker.get("restart", 0)):
            refusal = f"{marker.get('message')} (restart {_restart_count()} stops at once)"
        elif marker is not None:
            path.unlink(missing_ok=True)
    if across_ranks(trainer):
        import torch.distributed as dist

        box = [refusal]
        dist.broadcast_object_list(box, src=0)
        refusal = box[0]
    if refusal is not None:
        raise TrainingDiverged(refusal)


# --- collective parts (every rank, same order) -------------------------------------------


def _epoch_exhausted(trainer) -> bool:
    """The step just taken was the epoch's last."""
    return trainer.epoch_batches >= trainer.num_batches


def _save(trainer, session, at_epoch_end, metrics=None, announce=False):
    """A checkpoint (every rank takes part); ``announce``: its line is logged at info (a stop's
    or the run's last), else at debug."""
    from ddpx.rank.checkpoint_files import SHARDS_KEY, check_plain, rng_state
    from ddpx.train.stopping import across_ranks

    from .finite import finite_state

    step = trainer.global_step
    if session.saved == (step, at_epoch_end):  # same on every rank: all skip the collective
        return
    session.saved = (step, at_epoch_end)
    state = trainer.state_dict()
    check_plain(state, "checkpoint state")  # every rank, before any collective: all stop alike
    if not finite_state(trainer, state):  # the same answer on every rank
        since = f"between optimizer steps {session.finite_at + 1} and {step}" if session.finite_at < step else \
            f"at optimizer step {step}"
        trainer.nonfinite_weights(f"{since} (epoch {trainer.epoch})")  # raises under nonfinite=stop
        return
    session.finite_at = step
    sharded = trainer.strategy.sharded_entries(state)
    shards = _save_shards(trainer, session, step, {k: state[k] for k in sharded}) if sharded else None
    mine = {
        "rng": rng_state(trainer.device),
        "plugins": {k: v for k, v in state.items() if k not in TRAINER_STATE and k not in sharded},
    }
    if across_ranks(trainer):
        import torch.distributed as dist

        gathered = [None] * trainer.world_size if trainer.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
    else:
        gathered = [mine]
    trainer.shared[LAST_FINITE_CHECKPOINT] = str(session.directory.path_for(step))
    if trainer.rank != 0:
        return
    checkpoint = {
        "step": step,
        "world_size": trainer.world_size,
        "replicas": trainer.strategy.data_parallel(trainer)[1],  # what shards the data: ranks, or pipelines
        "strategy": trainer.strategy.name,
        "replicated": {k: v for k, v in state.items() if k in TRAINER_STATE and k not in sharded},
        "ranks": gathered,
    }
    if shards is not None:
        checkpoint[SHARDS_KEY] = shards
    progress = state.get("progress", {})
    score = _score(trainer, session, metrics) if metrics is not None else None

    # progress["epoch"] is the epoch a resume starts in: the next one once this one is done.
    epoch = progress.get("epoch", trainer.epoch)
    where = f"end of epoch {epoch - 1}" if epoch != trainer.epoch else f"in epoch {epoch}"

    def done(path):
        line = f"saved checkpoint {path} ({where}, step {step})"
        session.unannounced = None if announce else line
        trainer.log.log(logging.INFO if announce else logging.DEBUG, line)

    session.writer.save(checkpoint, step, on_done=done, score=score)


def _save_shards(trainer, session, step, state) -> str:
    """Every rank writes its part of ``state`` (the sharded entries) into the step's shard directory
    (a temporary one first, renamed by rank 0 once complete); returns the directory's name."""
    import shutil

    import torch.distributed as dist

    from ddpx.rank.checkpoint_files import fsync_directory
    from ddpx.train.stopping import across_ranks

    session.writer.wait()  # the previous write, and its pruning, are done before this directory exists
    final = session.directory.shards_for(step)
    partial = final.with_name(f".{final.name}.partial")
    if trainer.rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
    if across_ranks(trainer):
        dist.barrier()  # no rank writes into it before rank 0 cleared it
    trainer.strategy.save_shards(state, partial)  # returns once the metadata is written
    if trainer.rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        fsync_directory(final.parent)
    return final.name


def _write_trained_model(trainer) -> None:
    """Rank 0 writes the whole model into ``run_dir/model/`` (every rank takes part: the strategy
    may gather it)."""
    from ddpx.rank.model_files import MODEL_DIR, write_model

    weights = trainer.strategy.full_state_dict(trainer.module)
    if trainer.rank == 0:
        directory = trainer.run_dir / MODEL_DIR
        written, why = write_model(weights, directory, trainer.module)
        note = f" (not safetensors: {why})" if why else ""
        trainer.log.info(f"wrote the trained model to {directory}: {', '.join(written)}{note}")


def _score(trainer, session, metrics):
    """The monitored metric of an epoch-end checkpoint, for the best-K ranking."""
    monitor = session.monitor
    if monitor is None:
        return None
    value = monitor.value(metrics)
    if value is None:
        if not session.monitor_missing_warned:
            session.monitor_missing_warned = True
            keys = ", ".join(k for k in metrics if k not in ("epoch", "step"))
            trainer.log.warning(f"checkpoint.monitor '{monitor.name}' is not among epoch {metrics.get('epoch')}'s "
                                f"metrics ({keys}); that checkpoint is not ranked")
        return None
    if not math.isfinite(value):
        return None
    return {"monitor": monitor.name, "value": value, "epoch": metrics.get("epoch")}


def report_best(trainer, session) -> None:
    """Log (rank 0) which checkpoint is best by the monitored metric."""
    if trainer.rank != 0 or session.monitor is None:
        return
    best = [e for e in session.directory.best() if e.get("monitor") == session.monitor.name]
    if not best:
        trainer.log.info(f"no checkpoint ranked by {session.monitor.describe()} yet")
        return
    top, link = best[0], session.directory.directory / "best.pt"
    trainer.log.info(f"best checkpoint by {session.monitor.describe()}: {link} -> {top['file']} "
                     f"({top['monitor']} {top['value']:.6g}, epoch {top['epoch']})")



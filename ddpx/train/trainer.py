"""The trainer: one lifecycle and the epoch/step loop.

Every driver (``ddpx train``'s worker, the smoke run, the benchmarks) runs a
rank through the same public methods: :meth:`Trainer.setup`,
:meth:`Trainer.train` (to the end, or up to a step), :meth:`Trainer.finish`,
and :meth:`Trainer.close` on every exit path (:meth:`Trainer.run` is the four).

One optimizer step is :meth:`Trainer.train_step`; :meth:`Trainer.train_epoch`
feeds it windows of micro-batches and runs the checks between steps. Samplers,
AMP, accumulation, comm hooks, logging and checkpoints are plugins that shape
the step through hooks (see :mod:`ddpx.plugin.hookspecs` for the order). The default
bodies of the provider hooks live in :class:`ddpx.train.default_hooks.DefaultHooks`,
the plugin named "trainer", registered ``trylast`` so any plugin can take over.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import pathlib
import signal
import sys
import textwrap
from typing import Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ..config import Config, default_run_dir
from ..data.stream import has_length
from ..errors import DdpxError
from ..imports import instantiate
from ..plugin import hookspecs
from ..plugin.manager import plugin_signature, raised_by, rank_prefix
from ..plugin.shared import Shared
from ..rank import failures, process_group
from ..rank.watchdog import CollectiveWatchdog
from ..rank.logger import default_log_handler, logger_settings, restore_logger
from ..rank.run_lock import hold_run_dir
from ..rank.seeding import seed_rank
from .. import strategies
from ..data.batches import model_loss, to_device
from ..strategies.base import EpochMoved
from ..strategies.shards import shards_apart
from .compile import compile_model
from .grad_norms import GradientNorms
from .losses import EpochLosses, LossWindow
from .nonfinite import NonfiniteGuard
from .stopping import StopAgreement, StopSignals, TrainingStopped
from .stream_end import StreamEnd
from .agreement import UNCOUNTED, check_ranks_agree
from .scheduled import NEVER, ScheduledCalls
from .state import load_run_state, run_state
from .sync_batchnorm import convert_sync_batchnorm
from . import model_checks


class Trainer:
    """One rank's training run.

    A non-finite loss or weights (``trainer.nonfinite``): see
    :meth:`nonfinite_loss`; the trainer checks the epoch's all-reduced loss, the
    checkpoint plugin the loss between its stop checks and the weights before
    every save.

    Plugins that act only now and then (a save every N steps, a log line, a
    timing window) schedule a call with :meth:`call_at_step` instead of
    implementing ``ddpx_batch_end``, which runs every micro-batch; a window of
    the micro-batch losses comes from :meth:`open_loss_window`.

    What plugins may use (listed once, in :data:`ddpx.plugin.hookspecs.TRAINER_ATTRIBUTES`
    and :data:`~ddpx.plugin.hookspecs.TRAINER_METHODS`):

    """

    def __init__(self, config: Config, plugin_manager=None):
        self.config = config
        self.plugin_manager = plugin_manager if plugin_manager is not None else config.plugin_manager
        self.strategy = strategies.make(config)  # what the parallelism means for each part of the run
        self.hook = self.plugin_manager.calls  # pm.hook, minus pluggy's dispatch where that changes nothing
        self.rank, self.world_size, self.local_rank = 0, 1, 0
        self.device = torch.device("cpu")
        self.backend: Optional[str] = None
        self.model = self.module = self.optimizer = self.scheduler = self.loss_fn = None
        self.train_set = self.eval_set = self.train_loader = self.eval_loader = None
        self.epoch = 0
        self.global_step = 0
        self.batch_index = 0
        self.num_batches = 0
        self.epoch_batches = 0  # micro-batches of the running (or just finished) epoch trained so far by this run
        # Asked from the plugins once, before ddpx_train_start: the forward pass's
        # context (AMP's autocast) and the GradScaler (fp16 AMP; a disabled one otherwise).
        self.autocast = contextlib.nullcontext()
        self.scaler = torch.amp.GradScaler("cpu", enabled=False)
        self.skipped_steps = 0  # optimizer steps the scaler skipped (inf/NaN gradients)
        self.run_dir: Optional[pathlib.Path] = None
        self.last_loss: Optional[torch.Tensor] = None
        self.stop_requested = False
        self.metrics: list[dict] = []  # one dict per finished epoch
        self.log = logging.getLogger("ddpx")  # the logging plugin formats it (rank prefix, ranks shown)
        self._epoch_finished = False  # True only once the epoch's loader is exhausted
        self._stop_signal = signal.SIGTERM
        self.end_reason: Optional[str] = None  # set by end_training: the loop ends after this epoch
        self.shared = Shared()  # what the plugins of this run share (ddpx/plugin/shared.py)
        self._nonfinite = NonfiniteGuard(self)
        self._scheduled = ScheduledCalls()  # see call_at_step
        self._losses = EpochLosses()  # this epoch's micro-batch losses, summed only when read
        self._grad_clip = config.trainer.grad_clip  # read every step
        self._batch_device = None  # where batches are moved (None: they stay on the CPU)
        self._grad_norms: Optional[GradientNorms] = None  # made with the model
        self._unsynced = None  # the context for an accumulation window's backward passes but the last
        self._grad_norm_due = NEVER  # the next step whose gradient norm a logger asked for (watch_grad_norm)
        self.grad_norm: Optional[torch.Tensor] = None  # see clip_gradients
        self.grad_norm_step: Optional[int] = None
        self._signals = StopSignals(self)  # SIGTERM/SIGINT/SIGHUP during the run
        self.stop_agreement: Optional[StopAgreement] = None  # see agree_on_stops
        self._batches = None  # the running epoch's batch iterator, kept while train() pauses
        self._stream_end: Optional[StreamEnd] = None  # the running epoch's, over a loader without __len__
        self._saved_logger: Optional[tuple] = None  # what close() restores
        self._plugins_before: Optional[set] = None
        self._closed = False
        self._run_lock = None  # rank 0's lock on run_dir (ddpx/rank/run_lock.py)
        self._collectives: Optional[CollectiveWatchdog] = None  # trainer.check_collectives
        # Set by close() when the run failed because another rank did: the one line to print
        # instead of a traceback (ddpx/rank/failures.py).
        self.peer_failure: Optional[str] = None
        self.failure_store = None  # set by close() after a failure: the store the failing ranks report through

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def epoch_finished(self) -> bool:
        """Whether every batch of the running epoch was trained (a checkpoint then resumes in the next one)."""
        return self._epoch_finished

    @property
    def epoch_losses(self) -> EpochLosses:
        """The running epoch's micro-batch losses (device tensors, summed only when read)."""
        return self._losses

    # --- lifecycle: setup -> train -> finish, and close on every exit path -------------------

    def run(self) -> list[dict]:
        """What ``ddpx train`` runs on each rank: :meth:`setup`, :meth:`train` to the end,
        :meth:`finish`, and :meth:`close` on every exit path. Returns the per-epoch
        metrics; an exception propagates after every plugin's ``ddpx_exception``."""
        with self:
            self.setup()
            self.train()
            self.finish()
        return self.metrics

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close(exc)
        return False

    def setup(self) -> None:
        """Start this rank's run: take SIGTERM/SIGINT/SIGHUP, join the process group, build the
        model, optimizer and data through the hooks, then ``ddpx_train_start`` (a
        checkpoint is restored there). Pair it with :meth:`close`."""
        self._saved_logger = logger_settings(self.log)
        self._plugins_before = set(self.plugin_manager.get_plugins())
        self._signals.install()
        self._build()
        # built alike everywhere; from here one stream per data-parallel replica (a rank under ddp)
        seed_rank(self.config.seed, self.strategy.data_parallel(self)[0])
        self.hook.ddpx_train_start(trainer=self)  # checkpoint restore may move epoch/global_step
        self.strategy.start(self)

    def train(self, until_step: Optional[int] = None) -> list[dict]:
        """Train until ``trainer.epochs`` or ``trainer.max_steps``, or until a plugin
        ends training (:meth:`end_training`); with ``until_step``, stop at the first
        optimizer-step boundary with ``global_step >= until_step`` (a later call goes
        on from there, in the same epoch). Returns the metrics of every finished epoch."""
        epochs = self.config.trainer.epochs
        try:
            while self.epoch < epochs and self.global_step < self._stop_step(until_step) and self.end_reason is None:
                try:
                    self.train_epoch(self.epoch, until_step)
                except EpochMoved:  # live recovery healed this group into another epoch: train that one
                    self._batches = None
                    continue
                if not self._epoch_finished:
                    break  # cut short by max_steps or until_step: a later run or call continues this epoch
                self.epoch += 1
                self._epoch_finished = False  # nothing of the next epoch is consumed yet
        except RuntimeError as exc:
            unused = model_checks.explain_unused(exc, self.model, self.global_step)
            if unused is None:
                raise
            raise unused from exc
        return self.metrics

    def finish(self) -> None:
        """Training ended normally: ``ddpx_train_end`` (the final checkpoint)."""
        if self.end_reason is not None:
            self.log.info(f"training ended after epoch {self.epoch - 1}: {self.end_reason}")
        self.hook.ddpx_train_end(trainer=self)
        if self.stop_agreement is not None:  # after a failure close() only releases it: no collective
            self.stop_agreement.finish()  # the vote every rank started, before the group goes

    def close(self, exc: Optional[BaseException] = None) -> None:
        """End this rank's run, also after a failure, and leave the process as it was. With ``exc``:
        name the plugin whose hook raised it (:func:`ddpx.plugin.manager.raised_by`), then call every
        plugin's ``ddpx_exception``. Then: the previous signal handlers, the DDP model freed before the
        process group is destroyed, the plugins attached during the run detached, the logger restored.
        Safe to call again (it does nothing) and after a :meth:`setup` that failed half-way."""
        if self._closed:
            return
        self._closed = True
        if exc is not None:
            self._report_exception(exc)
        if self.stop_agreement is not None:
            self.stop_agreement.release()
        self._signals.restore()  # first: a signal now acts as it did before the run
        if self._collectives is not None:
            self._collectives.stop()  # before the store goes with the group
            self._collectives.uninstall()
        try:
            # Free the DDP wrapper (its reducer holds the process group) before
            # destroying the group: otherwise torch 2.13 + gloo aborts at exit
            # now and then ("terminate called without an active exception").
            self.model = None
            process_group.teardown()
        finally:
            if self._run_lock is not None:
                self._run_lock.release()
            # After every plugin's last message: leave the process as it was
            # (a later run or test in the same process sees its own settings).
            for plugin in set(self.plugin_manager.get_plugins()) - (self._plugins_before or set()):
                self.plugin_manager.unregister(plugin)  # per-run helper plugins attached
            if self._saved_logger is not None:
                restore_logger(self.log, self._saved_logger)

    def _report_exception(self, exc: BaseException) -> None:
        store = self.failure_store = process_group.run_store()  # kept: the group goes before the worker reports
        if failures.is_peer_failure(exc):
            # Another rank failed, died or hung: the plugin whose collective broke is not to blame.
            self.peer_failure = failures.peer_failure_line(exc, store, self.global_step)
        elif not isinstance(exc, (TrainingStopped, KeyboardInterrupt)):
            failures.record_first_failure(store, self.rank, exc, self.strategy.describe_rank(self))
        where = raised_by(self.plugin_manager, exc)  # before the run's plugins are detached
        if where is not None and self.peer_failure is None \
                and not isinstance(exc, (DdpxError, TrainingStopped, KeyboardInterrupt)):
            plugin, hook = where  # the worker's one line names them too (ddpx/rank/failures.failure_line)
            if hasattr(exc, "add_note"):  # Python 3.11+: shown under the traceback
                exc.add_note(f"(raised by plugin '{plugin}' in {hook})")
        try:
            self.hook.ddpx_exception(trainer=self, exc=exc)
        except Exception as hook_exc:  # never hide the original error
            self.log.error(f"a ddpx_exception hook failed too: {type(hook_exc).__name__}: {hook_exc}")

    def agree_on_stops(self, every_steps: int, every_s: float, timeout_s: float, timeout_key: str,
                       what: str) -> StopAgreement:
        """Take SIGTERM/SIGINT/SIGHUP through a :class:`~ddpx.train.stopping.StopAgreement`: every rank
        stops after the same step (the plugin calling this, from ``ddpx_setup``, asks ``agreement.check(
        trainer)`` at the boundaries it schedules, then :meth:`request_stop`); released at the run's end."""
        self.stop_agreement = StopAgreement(self, every_steps, every_s, timeout_s, timeout_key, what)
        return self.stop_agreement

    def _build(self) -> None:
        cfg = self.config.trainer
        info = process_group.init_process_group(cfg.backend, cfg.device, cfg.first_timeout_s)
        self.rank, self.world_size, self.local_rank = info.rank, info.world_size, info.local_rank
        self.backend, self.device = info.backend, info.device
        self._batch_device = None if self.device.type == "cpu" else self.device  # .to() per tensor costs even on CPU
        run_dir = process_group.agree(plugin_signature(self.plugin_manager), self._propose_run_dir())
        process_group.set_timeout(cfg.timeout_s)
        self.run_dir = pathlib.Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._run_lock = hold_run_dir(self.run_dir, self.rank, self.world_size, process_group.adopted_group_id())
        if cfg.check_collectives and self.world_size > 1:
            self._collectives = CollectiveWatchdog(self.rank, self.world_size, cfg.stall_s, self._progress,
                                                   self.plugin_manager, self.run_dir,
                                                   process_group.run_store(), self.device)
            self._collectives.install()
            self._collectives.start()
        torch.manual_seed(self.config.seed)  # identical initial weights and default shuffles on every rank
        self.hook.ddpx_setup(trainer=self)
        if not self.log.handlers:
            default_log_handler(self.log, self.rank)

        self.module = self.hook.ddpx_build_model(trainer=self).to(self.device)
        if cfg.sync_batchnorm:
            self.module = convert_sync_batchnorm(self.module, self.device)
        self.loss_fn = instantiate(self.config.loss, "loss") if self.config.loss.target else None
        if self._collectives is not None:
            model_checks.check_same_model(self.module)
        self.model = self.hook.ddpx_wrap_model(trainer=self, model=self.module)
        self._unsynced = self.strategy.no_sync(self.model)
        self._grad_norms = GradientNorms(self.module, self.strategy)  # after the wrap: FSDP replaces the parameters
        self.hook.ddpx_model_wrapped(trainer=self, model=self.model)  # comm hooks go on the DDP model
        if cfg.compile:
            self.model = compile_model(self.model, cfg.compile, self.device, cfg.compile_dynamic)
        self.optimizer = instantiate(self.config.optimizer, "optimizer", self.module.parameters())
        if self.config.scheduler.target:
            self.scheduler = instantiate(self.config.scheduler, "scheduler", self.optimizer)
        self.train_set, self.eval_set = self._datasets()
        self.train_loader, self.eval_loader = self.hook.ddpx_build_dataloaders(
            trainer=self, train_set=self.train_set, eval_set=self.eval_set
        )
        self.autocast = self.hook.ddpx_autocast(trainer=self) or contextlib.nullcontext()
        self.scaler = self.hook.ddpx_grad_scaler(trainer=self) or torch.amp.GradScaler(self.device.type, enabled=False)

    def _progress(self) -> dict:
        """Where training is (read by the collectives' watchdog thread)."""
        return {"step": self.global_step, "epoch": self.epoch, "batch": self.epoch_batches,
                "batches": self.num_batches, "place": self.strategy.describe_rank(self)}

    def _propose_run_dir(self) -> str:
        if self.config.run_dir:
            return os.path.abspath(self.config.run_dir)
        return default_run_dir()

    def _datasets(self):
        data = instantiate(self.config.data, "data")
        if isinstance(data, (tuple, list)):
            if len(data) != 2:
                raise DdpxError(f"data.target {self.config.data.target} returned {len(data)} items; return (train_set, eval_set) or a train set")
            return data[0], data[1]
        return data, None

    # --- the loop ----------------------------------------------------------------------

    def _stop_step(self, until_step: Optional[int] = None) -> int:
        """The step :meth:`train` stops at: ``trainer.max_steps`` or ``until_step``, the sooner."""
        return min(s for s in (self.config.trainer.max_steps, until_step, NEVER) if s is not None)

    def train_epoch(self, epoch: int, until_step: Optional[int] = None) -> Optional[dict]:
        """One epoch (or its rest, after a resume), up to the step :meth:`train` stops at.
        Returns the epoch's metrics, or None when ``until_step`` paused it: the next
        call goes on with the same epoch's batches."""
        if self._batches is None:  # a new epoch, not one paused by until_step
            self._epoch_finished = False
            self._losses.start_epoch()
            self.epoch_batches = 0
            self.hook.ddpx_epoch_start(trainer=self, epoch=epoch)
            self.num_batches = _batches_in(self.train_loader)
            if self._collectives is not None:
                check_ranks_agree(self, self._collectives, at_start=True)
            self._batches = iter(self.train_loader)
            self._stream_end = None
            if self.num_batches == UNCOUNTED:
                self._stream_end = StreamEnd(self)
                self._batches = self._stream_end.start(self._batches)
        stop_at = self._stop_step(until_step)
        self.module.train()
        while self.epoch_batches < self.num_batches and self.global_step < stop_at:
            self.strategy.begin_step(self)  # live recovery: the quorum (it may lay the epoch out anew)
            if self.epoch_batches >= self.num_batches:
                break
            first = self.epoch_batches
            window = self.hook.ddpx_step_window(trainer=self, batch_index=first, num_batches=self.num_batches)
            if window is None:
                window = 1  # no plugin accumulates: every micro-batch is an optimizer step
            elif window < 1:
                raise DdpxError(f"a ddpx_step_window hook returned {window} micro-batches at batch {first}; "
                                "an optimizer step needs at least 1")
            batches = list(itertools.islice(self._batches, window))
            padding = 0
            if len(batches) < window:
                if self._stream_end is not None:  # this rank's stream ran out: see StreamEnd
                    padding = self._stream_end.padding_passes(len(batches), window)
                if not batches and not padding:
                    break  # the loader ended early (a stream: the epoch's data ended)
            losses, applied = self.train_step(batches, padding)
            if self.hook.ddpx_batch_end.get_hookimpls():
                for i, loss in enumerate(losses):
                    stepped = applied and i == len(losses) - 1
                    self.hook.ddpx_batch_end(trainer=self, batch_index=first + i, loss=loss, stepped=stepped)
            if self.global_step >= self._scheduled.next_step:
                self.run_due_calls()
            if self.stop_requested:
                raise TrainingStopped(self._stop_signal)
        self._epoch_finished = self.epoch_batches >= self.num_batches
        if not self._epoch_finished and self.global_step < self._stop_step():
            return None  # paused by until_step: no epoch end yet
        self._batches = None
        return self._end_epoch(epoch)

    def restart_batches(self) -> None:
        """Draw the rest of the epoch's batches anew from the sampler's position (live recovery)."""
        self._batches = iter(self.train_loader)
        self.num_batches = self.epoch_batches + _batches_in(self.train_loader)

    def _end_epoch(self, epoch: int) -> dict:
        """The epoch's all-reduced loss, the evaluation when due, then ``ddpx_epoch_end``."""
        metrics: dict = {"epoch": epoch, "step": self.global_step, **self._epoch_train_loss()}
        if self._collectives is not None:
            check_ranks_agree(self, self._collectives, at_start=False)
        if not math.isfinite(metrics.get("loss", 0.0)) and not self.scaler.is_enabled():  # else fp16 overflows
            self.nonfinite_loss(f"in epoch {epoch} (its mean training loss is {metrics['loss']})")
        every = self.config.trainer.eval_every_epochs
        last = epoch + 1 >= self.config.trainer.epochs or self.global_step >= self._stop_step()
        if self.eval_loader is not None and every and ((epoch + 1) % every == 0 or last):
            for key, value in self.evaluate().items():
                metrics[key if key not in metrics else f"eval_{key}"] = value
        self.metrics.append(metrics)
        self.hook.ddpx_epoch_end(trainer=self, epoch=epoch, metrics=metrics)
        return metrics

    def train_step(self, batches: list, padding: int = 0) -> tuple[list, bool]:
        """One optimizer step over ``batches``, the micro-batches of one accumulation
        window: forward and backward of each (the gradients are reduced on the last
        one only: DDP's no_sync, FSDP's set_requires_gradient_sync), then
        ``ddpx_optimizer_step`` (clip and step), zero the gradients, step the LR scheduler.
        ``padding``: passes of weight 0 that end the window
        (:class:`~ddpx.train.stream_end.StreamEnd`: this rank's stream ran out).
        Returns the micro-batches' losses (detached) and whether the step was applied
        (fp16 AMP skips a step whose gradients overflowed)."""
        losses = []
        window = len(batches) + padding
        for i, batch in enumerate(batches):
            self.batch_index = self.epoch_batches
            if i < window - 1 and self._unsynced is not None:
                with self._unsynced():  # gradients are reduced on the window's last micro-batch only
                    loss = self.forward_backward(batch, window=window)
            else:
                loss = self.forward_backward(batch, window=window)
            self.epoch_batches += 1
            losses.append(loss)
        if padding:
            self._stream_end.pad(padding)
        if not self.strategy.commit_step(self, len(batches)):  # live recovery: another replica group failed
            self.optimizer.zero_grad(set_to_none=True)
            self.epoch_batches -= len(batches)
            return [], False
        for loss in losses:
            self._losses.append(loss)  # summed when read: no host sync per step
        if losses:
            self.last_loss = losses[-1]
        applied = self.hook.ddpx_optimizer_step(trainer=self) is not False
        if not applied:
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        if applied and self.scheduler is not None:
            self.scheduler.step()
        self.global_step += 1
        return losses, applied

    def forward_backward(self, batch, window: float) -> torch.Tensor:
        """Forward (``ddpx_forward``, in ``autocast``) and backward of one micro-batch; returns its loss,
        detached. The back-propagated loss is divided by ``window``, so the step's gradient is the
        window's mean (``math.inf``: no gradient, a padding pass of :mod:`~ddpx.train.stream_end`)."""
        if self._batch_device is not None:
            batch = to_device(batch, self._batch_device)
        return self.strategy.forward_backward(self, batch, window)  # a pipeline runs its schedule here

    def batch_loss(self, batch) -> torch.Tensor:
        """The default ``ddpx_forward``: :func:`~ddpx.data.batches.model_loss`'s loss of one micro-batch."""
        return model_loss(self.model, self.loss_fn, batch)[0]

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss``, scaled by the GradScaler under fp16 AMP."""
        self.scaler.scale(loss).backward()

    def _epoch_train_loss(self) -> dict:
        """``{"loss": the epoch's mean micro-batch loss over all ranks}`` (empty: no batch); one all_reduce."""
        loss_sum, batches = self._losses.epoch_total()
        if loss_sum is None or not self.strategy.counts_loss(self):
            loss_sum, batches = torch.zeros((), dtype=torch.float64), 0
        totals = torch.stack([loss_sum.to(self.device), torch.tensor(float(batches), dtype=torch.float64,
                                                                      device=self.device)])
        dist.all_reduce(totals)
        return {"loss": (totals[0] / totals[1]).item()} if totals[1] > 0 else {}

    # --- the end of training: early, or because the loss diverged ----------------------

    def end_training(self, reason: str) -> None:
        """Finish normally (``ddpx_train_end``, final checkpoint, exit 0) after the
        running epoch ends. Call it on every rank in the same epoch (e.g. from
        ``ddpx_epoch_end``, whose metrics are the same on every rank)."""
        if self.end_reason is None:
            self.end_reason = reason

    def nonfinite_loss(self, where: str) -> None:
        """The loss went non-finite ``where`` (e.g. "in epoch 3"): act on ``trainer.nonfinite``. Called on
        every rank at the same boundary, from all-reduced values only: ``stop`` raises
        :class:`TrainingDiverged` everywhere; ``warn`` logs a warning (rank 0) and goes on. Under fp16 AMP
        the GradScaler skips steps with non-finite gradients, so callers ask once its scale collapsed."""
        self._nonfinite.loss(where)

    def nonfinite_weights(self, where: str) -> None:
        """The weights or optimizer state are non-finite ``where`` (the checkpoint
        plugin checks before every save, which it then skips): as :meth:`nonfinite_loss`."""
        self._nonfinite.weights(where)

    def evaluate(self, loader: Optional[DataLoader] = None) -> dict:
        """Metrics on ``loader`` (default: the eval loader), reduced over all ranks."""
        return self.hook.ddpx_evaluate(trainer=self, loader=loader or self.eval_loader) or {}

    def clip_gradients(self) -> Optional[torch.Tensor]:
        """Clip the gradient norm to ``trainer.grad_clip``; returns the norm (None when
        no norm was computed). Called right before the optimizer step, with true
        (unscaled) gradients. The total norm is computed every step with
        ``grad_clip`` and otherwise only at the steps asked for with
        :meth:`watch_grad_norm`; it is kept, on the device, in ``grad_norm``
        (``grad_norm_step``: the optimizer step it belongs to)."""
        max_norm = self._grad_clip
        step = self.global_step + 1  # this optimizer step's number
        if not max_norm and step < self._grad_norm_due and not self._grad_norms.collective:
            return None  # a collective norm (sharded gradients) every step: a logger asks on rank 0 only
        norm = self._grad_norms.compute(step, track=not self.scaler.is_enabled())
        self.grad_norm, self.grad_norm_step = norm, step
        if step >= self._grad_norm_due:
            self._grad_norm_due = NEVER  # done: the logger asks for its next one
        if max_norm:  # DTensors apart from plain tensors (tensor parallelism holds both): foreach refuses a mix
            for group in shards_apart(self.module.parameters()):
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
        return norm

    def watch_grad_norm(self, step: int) -> None:
        """Compute the total gradient norm (``grad_norm``) at the optimizer step that brings ``global_step``
        to ``step`` (the first one at or after it), even without ``grad_clip``: a logger asks for the
        steps it writes, so the other steps pay one integer comparison."""
        self._grad_norm_due = min(self._grad_norm_due, int(step))

    # --- checkpoints -------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything a checkpoint holds (:func:`ddpx.train.state.run_state`): the trainer's
        ``model``, ``optimizer``, ``scheduler`` and ``progress``, each plugin object's
        ``state_dict()`` under the plugin's name, and module plugins' ``ddpx_state_dict`` entries."""
        return run_state(self)

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` holds (:func:`ddpx.train.state.load_run_state`)."""
        load_run_state(self, state)

    # --- plugins -----------------------------------------------------------------------

    def plugin(self, name: str):
        """The registered plugin ``name``: a built-in plugin is one object that holds its
        per-run state (``trainer.plugin("comm_hook").state``). A plugin that is not
        loaded is a one-line error; :meth:`has_plugin` asks first."""
        found = self.plugin_manager.get_plugin(name)
        if found is None:
            raise DdpxError(f"plugin '{name}' is not loaded (blocked by plugins.block, or not installed: "
                            "`ddpx plugins` lists what a run loads)")
        return found

    def has_plugin(self, name: str) -> bool:
        """Whether plugin ``name`` is loaded in this run."""
        return self.plugin_manager.get_plugin(name) is not None

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """Stop at the next batch boundary. Every rank must call it at the same step
        (the checkpoint plugin agrees on that with one all_reduce)."""
        self.stop_requested = True
        self._stop_signal = signum

    # --- scheduled calls and loss windows ------------------------------------------------

    def call_at_step(self, step: int, callback) -> None:
        """Call ``callback(trainer)`` once, at the first optimizer-step boundary with ``global_step >=
        step``, after that micro-batch's ``ddpx_batch_end`` hooks. Calls due at one boundary run in the
        order they were scheduled; one scheduled while those run, for a step already reached, runs at
        the next boundary. The loop pays one integer comparison per step, however many calls wait.
        A callback that communicates must be scheduled for the same steps, in the same order, on every
        rank (steps from the config, ``global_step`` and all-reduced values only)."""
        self._scheduled.add(step, callback)

    @property
    def next_due_step(self) -> int:
        """The step of the next call scheduled with :meth:`call_at_step` (``sys.maxsize``: none)."""
        return self._scheduled.next_step

    def run_due_calls(self) -> None:
        """Run the calls due at ``global_step`` (the loop does, at a boundary ``>= next_due_step``)."""
        step = self.global_step
        for callback in self._scheduled.take_due(step):
            if self.plugin_manager.tracing:
                name = getattr(callback, "__qualname__", repr(callback))
                print(f"{rank_prefix()}call at step {step}: {callback.__module__}.{name}", file=sys.stderr,
                      flush=True)
            callback(self)

    def open_loss_window(self) -> LossWindow:
        """A :class:`~ddpx.train.losses.LossWindow` over the micro-batch losses from now
        on (the logging plugin's step lines and the checkpoint plugin's non-finite
        check use one)."""
        return self._losses.open_window()


def _batches_in(loader) -> int:
    """``len(loader)``, or :data:`UNCOUNTED` for a loader without one (a stream)."""
    return len(loader) if has_length(loader) else UNCOUNTED


if Trainer.__doc__ is not None:  # None under python -OO
    Trainer.__doc__ += textwrap.indent(hookspecs.trainer_attribute_text(), "    ") + "\n"

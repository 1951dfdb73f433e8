"""The core trainer: set-up, the epoch/step loop, evaluation, teardown.

The core only calls hooks (see :mod:`ddpx.hookspecs` for the order); samplers,
AMP, accumulation, comm hooks, logging and checkpoints are plugins. The default
bodies of the provider and wrapper hooks live in :class:`CorePlugin`, which is
registered ``trylast`` so any plugin can take over.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import logging
import math
import os
import pathlib
import signal
import sys
import threading
from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from . import distributed
from .config import Config, default_run_dir, instantiate, resolve
from .errors import DdpxError, TrainingDiverged
from .plugin import hookimpl, plugin_signature, rank_prefix
from .losses import EpochLosses, LossWindow
from .step_hooks import step_callers


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
NEVER = sys.maxsize  # the next due step when nothing is scheduled


class TrainingStopped(Exception):
    """Raised when SIGTERM/SIGINT asked the run to stop: at a batch boundary every
    rank agreed on (a plugin set ``trainer.stop_signal_handler``), or at once."""

    def __init__(self, signum: int, detail: str = ""):
        super().__init__(f"stopped by signal {signal.Signals(signum).name}{detail}")
        self.signum = signum


def to_device(batch: Any, device: torch.device) -> Any:
    """Move tensors in a (nested) tuple/list/dict batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


LABELS = "labels"  # the targets' key in a dict batch when the config names a loss


def model_loss(model, loss_fn, batch) -> tuple:
    """``(loss, outputs, targets)`` of one batch.

    With a loss function (``loss.target``): a sequence batch is ``(inputs,
    targets, ...)`` and the loss ``loss_fn(model(inputs), targets)`` (inputs may
    be nested); a dict batch passes every entry but ``labels`` to the model as
    keyword arguments, and ``labels`` are the targets. Without one
    (``loss.target: null``) the model computes its own loss, as Hugging Face
    models do: it is called as ``model(**batch)`` (dict), ``model(*batch)``
    (sequence) or ``model(batch)``, and returns the loss or an output with a
    ``loss`` (attribute or key); targets are then None.
    """
    # Sequences first: the Mapping check is an ABC check, slower than list/tuple's.
    if loss_fn is not None:
        if isinstance(batch, (list, tuple)) or not isinstance(batch, Mapping):
            targets = batch[1]
            outputs = model(batch[0])
        else:
            if LABELS not in batch:
                raise DdpxError(f"a dict batch needs a '{LABELS}' entry (the targets of loss.target); it has "
                                f"{', '.join(map(str, batch))}; or set loss.target=null for a model that computes its loss")
            targets = batch[LABELS]
            outputs = model(**{k: v for k, v in batch.items() if k != LABELS})
        return loss_fn(outputs, targets), outputs, targets
    if isinstance(batch, (list, tuple)):
        outputs = model(*batch)
    elif isinstance(batch, Mapping):
        outputs = model(**batch)
    else:
        outputs = model(batch)
    if isinstance(outputs, torch.Tensor):
        return outputs, outputs, None
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise DdpxError(f"loss.target is null, so the model must return its loss (a tensor, or an output with a "
                        f"'loss'), but it returned {type(outputs).__name__}; set loss.target to a loss function")
    return loss, outputs, None


def batch_size(batch, targets=None) -> int:
    """Samples in a batch: the targets' first dimension, else the first tensor's."""
    if isinstance(targets, torch.Tensor):
        return targets.shape[0]
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        n = batch_size(item)
        if n:
            return n
    return 0


def _logger_settings(log: logging.Logger) -> tuple:
    return list(log.handlers), log.level, log.propagate


def _restore_logger(log: logging.Logger, settings: tuple) -> None:
    handlers, level, propagate = settings
    for handler in list(log.handlers):
        if handler not in handlers:
            log.removeHandler(handler)
    for handler in handlers:
        if handler not in log.handlers:
            log.addHandler(handler)
    log.setLevel(level)
    log.propagate = propagate


def ddp_options(config: Config, requests) -> dict:
    """``DistributedDataParallel`` keyword arguments: what plugins ask for
    (``ddpx_ddp_options`` results) where the config leaves it open, then the
    config's ``trainer.find_unused_parameters``, ``static_graph`` and a
    non-null ``bucket_cap_mb`` and ``gradient_as_bucket_view``."""
    cfg = config.trainer
    configured = {"find_unused_parameters": cfg.find_unused_parameters, "static_graph": cfg.static_graph}
    for key in ("bucket_cap_mb", "gradient_as_bucket_view"):
        if cfg[key] is not None:
            configured[key] = cfg[key]
    asked: dict = {}
    for options in requests:
        for key, value in (options or {}).items():
            if key in configured:
                continue
            if asked.get(key, value) != value:
                raise DdpxError(f"plugins ask for different DistributedDataParallel {key}: {asked[key]!r} and "
                                f"{value!r}; set trainer.{key} in the config")
            asked[key] = value
    return {**asked, **configured}


def compile_model(model: torch.nn.Module, backend, device: torch.device) -> torch.nn.Module:
    """``trainer.compile``: ``torch.compile`` of the DDP-wrapped model, torch's DDP-aware
    path (graphs split at bucket boundaries so communication overlaps the backward);
    the comm hook registered on the DDP model stays in charge of communication.
    ``backend``: true for inductor, or a torch.compile backend name. Where it cannot
    work, a one-line error before training."""
    backend = "inductor" if backend is True else backend
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        raise DdpxError(f"trainer.compile: torch.compile does not support Python {sys.version.split()[0]} with torch "
                        f"{torch.__version__}; set trainer.compile=false")
    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise DdpxError(f"trainer.compile: unknown backend {backend!r}; use true (inductor) or one of "
                        f"{', '.join(torch._dynamo.list_backends())}")
    if backend == "inductor" and device.type == "cpu":
        import shutil

        compilers = [os.environ.get("CXX"), "g++", "c++", "clang++"]
        if not any(c and shutil.which(c) for c in compilers):
            raise DdpxError("trainer.compile: inductor on CPU needs a C++ compiler (none found: install g++ or set CXX); "
                            "or set trainer.compile=false")
    if backend == "inductor" and device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise DdpxError("trainer.compile: inductor on CUDA needs triton (pip install triton); or set trainer.compile=false")
    return torch.compile(model, backend=backend)


def default_log_handler(log: logging.Logger, rank: int) -> None:
    """A ``[rankN]`` stderr handler, rank 0 INFO only, for when no plugin configured the logger."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[rank{rank}] %(message)s"))
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)


class Trainer:
    """One rank's training run. Public attributes (plugins may read them):

    ``config``, ``plugin_manager``, ``rank``, ``world_size``, ``local_rank``,
    ``device``, ``backend``, ``model`` (wrapped, e.g. DDP), ``module``
    (unwrapped), ``optimizer``, ``scheduler``, ``loss_fn``, ``train_set``,
    ``eval_set``, ``train_loader``, ``eval_loader``, ``epoch`` (0-based, the
    epoch running or about to run), ``global_step`` (optimizer-step
    boundaries so far), ``batch_index`` (micro-batch in the epoch),
    ``num_batches`` (micro-batches of the running epoch on this rank, from
    ``len(train_loader)`` at its start), ``epoch_batches`` (micro-batches of it
    trained so far by this run),
    ``run_dir`` (pathlib.Path, exists on every rank), ``last_loss`` (detached
    tensor of the last micro-batch), ``is_main`` (rank 0), ``log`` (rank-aware
    logger ``ddpx``), ``stop_requested`` (set through :meth:`request_stop`, e.g.
    by the checkpoint plugin's signal handling; the loop stops at the next
    batch boundary and raises :class:`TrainingStopped`),
    ``stop_signal_handler`` (a plugin's callable taking SIGTERM/SIGINT; see
    "signals" below), ``end_reason`` (why training ends early, set through
    :meth:`end_training`, e.g. by early stopping), ``last_finite_checkpoint``
    (the newest checkpoint saved or resumed, all of which hold finite weights;
    set by the checkpoint plugin).

    A non-finite loss or weights (``trainer.nonfinite``): see
    :meth:`nonfinite_loss`; the core checks the epoch's all-reduced loss, the
    checkpoint plugin the loss between its stop checks and the weights before
    every save.

    Plugins that act only now and then (a save every N steps, a log line, a
    timing window) schedule a call with :meth:`call_at_step` instead of
    implementing ``ddpx_batch_end``, which runs every micro-batch; a window of
    the micro-batch losses comes from :meth:`open_loss_window`.
    """

    def __init__(self, config: Config, plugin_manager=None):
        self.config = config
        self.plugin_manager = plugin_manager if plugin_manager is not None else config.plugin_manager
        self.hook = self.plugin_manager.hook
        self.rank, self.world_size, self.local_rank = 0, 1, 0
        self.device = torch.device("cpu")
        self.backend: Optional[str] = None
        self.model = self.module = self.optimizer = self.scheduler = self.loss_fn = None
        self.train_set = self.eval_set = self.train_loader = self.eval_loader = None
        self.epoch = 0
        self.global_step = 0
        self.batch_index = 0
        self.num_batches = 0
        self.run_dir: Optional[pathlib.Path] = None
        self.last_loss: Optional[torch.Tensor] = None
        self.stop_requested = False
        self.metrics: list[dict] = []  # one dict per finished epoch
        self.log = logging.getLogger("ddpx")  # the logging plugin formats it (rank prefix, ranks shown)
        self._epoch_finished = False  # True only once the epoch's loader is exhausted
        self._stop_signal = signal.SIGTERM
        # Called with the signal number on SIGTERM/SIGINT instead of stopping at
        # once; the checkpoint plugin sets it to agree on a stop across ranks.
        self.stop_signal_handler = None
        self.end_reason: Optional[str] = None  # set by end_training: the loop ends after this epoch
        # Set by the checkpoint plugin: named when training diverges.
        self.last_finite_checkpoint: Optional[str] = None
        # A plugin skips optimizer steps with non-finite gradients (fp16 AMP's
        # GradScaler): a non-finite loss is then an overflow, not divergence.
        self.skips_nonfinite_steps = False
        self._nonfinite_warned: dict = {}  # what (loss, weights) was warned about in which epoch
        self._callers: Optional[dict] = None  # the per-step hook callables of the running epoch
        self._due: list = []  # heap of (step, order, callback): see call_at_step
        self._due_order = itertools.count()  # same-step calls run in the order they were scheduled
        self._next_due = NEVER
        self._losses = EpochLosses()  # this epoch's micro-batch losses, summed only when read
        self._grad_clip = config.trainer.grad_clip  # read every step
        self._previous_signal_handlers: dict = {}

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def epoch_batches(self) -> int:
        """Micro-batches of the running (or just finished) epoch trained so far by this run."""
        return self._losses.count

    # --- lifecycle ---------------------------------------------------------------------

    def run(self) -> list[dict]:
        """Set up, train, tear down (``destroy_process_group`` on every exit path).

        Returns the per-epoch metrics. On an exception every plugin's
        ``ddpx_exception`` runs, then the exception propagates.
        """
        saved_logger = _logger_settings(self.log)
        plugins_before = set(self.plugin_manager.get_plugins())
        self._install_signal_handlers()
        try:
            self.setup()
            self.fit()
            return self.metrics
        except BaseException as exc:
            self._notify_exception(exc)
            raise
        finally:
            self._restore_signal_handlers()  # first: a signal now acts as it did before the run
            try:
                # Free the DDP wrapper (its reducer holds the process group) before
                # destroying the group: otherwise torch 2.13 + gloo aborts at exit
                # now and then ("terminate called without an active exception").
                self.model = None
                gc.collect()
                distributed.teardown()
            finally:
                # After every plugin's last message: leave the process as it was
                # (a later run or test in the same process sees its own settings).
                for plugin in set(self.plugin_manager.get_plugins()) - plugins_before:
                    self.plugin_manager.unregister(plugin)  # per-run helper plugins attached
                _restore_logger(self.log, saved_logger)

    # --- signals -----------------------------------------------------------------------
    #
    # The trainer is the one owner of SIGTERM/SIGINT during a run: it installs the
    # handlers before any plugin's setup and restores the previous ones at the
    # end. A plugin that can stop every rank at the same batch boundary (the
    # checkpoint plugin: one all_reduce of the flags) takes the signal through
    # ``trainer.stop_signal_handler``. Without one, a rank cannot stop at a
    # boundary the others agree on (a rank stopping alone would leave its peers
    # blocked in the next collective), so the fallback raises
    # :class:`TrainingStopped` at once: teardown, a clear message, exit 128+signal.

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only
        for sig in STOP_SIGNALS:
            self._previous_signal_handlers[sig] = signal.signal(sig, self._on_stop_signal)

    def _on_stop_signal(self, signum, frame) -> None:
        # A second signal acts immediately (KeyboardInterrupt / termination).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if self.stop_signal_handler is not None:
            self.stop_signal_handler(signum)
            return
        raise TrainingStopped(signum, ": no plugin agrees on a stop across ranks (checkpoint plugin "
                              "blocked or not set up), exiting at once without a final checkpoint")

    def _restore_signal_handlers(self) -> None:
        handlers, self._previous_signal_handlers = self._previous_signal_handlers, {}
        for sig, handler in handlers.items():
            signal.signal(sig, handler)

    def setup(self) -> None:
        cfg = self.config.trainer
        info = distributed.init_process_group(cfg.backend, cfg.device, cfg.first_timeout_s)
        self.rank, self.world_size, self.local_rank = info.rank, info.world_size, info.local_rank
        self.backend, self.device = info.backend, info.device
        run_dir = distributed.agree(plugin_signature(self.plugin_manager), self._propose_run_dir())
        distributed.set_timeout(cfg.timeout_s)
        self.run_dir = pathlib.Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(self.config.seed)  # identical initial weights and default shuffles on every rank
        self.hook.ddpx_setup(trainer=self)
        if not self.log.handlers:
            default_log_handler(self.log, self.rank)

        self.module = self.hook.ddpx_build_model(trainer=self).to(self.device)
        if cfg.sync_batchnorm:
            from .batchnorm import convert_sync_batchnorm

            self.module = convert_sync_batchnorm(self.module, self.device)
        self.loss_fn = instantiate(self.config.loss, "loss") if self.config.loss.target else None
        self.model = self.hook.ddpx_wrap_model(trainer=self, model=self.module)
        self.hook.ddpx_model_wrapped(trainer=self, model=self.model)  # comm hooks go on the DDP model
        if cfg.compile:
            self.model = compile_model(self.model, cfg.compile, self.device)
        self.optimizer = instantiate(self.config.optimizer, "optimizer", self.module.parameters())
        if self.config.scheduler.target:
            self.scheduler = instantiate(self.config.scheduler, "scheduler", self.optimizer)
        self.train_set, self.eval_set = self._datasets()
        self.train_loader, self.eval_loader = self.hook.ddpx_build_dataloaders(
            trainer=self, train_set=self.train_set, eval_set=self.eval_set
        )

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

    def _notify_exception(self, exc: BaseException) -> None:
        try:
            self.hook.ddpx_exception(trainer=self, exc=exc)
        except Exception as hook_exc:  # never hide the original error
            self.log.error(f"a ddpx_exception hook failed too: {type(hook_exc).__name__}: {hook_exc}")

    # --- the loop ----------------------------------------------------------------------

    def fit(self) -> None:
        self.hook.ddpx_train_start(trainer=self)  # checkpoint restore may move epoch/global_step
        epochs = self.config.trainer.epochs
        while self.epoch < epochs and not self._max_steps_reached() and self.end_reason is None:
            self.train_epoch(self.epoch)
            if not self._epoch_finished:
                break  # cut short by max_steps: a resumed run continues this epoch
            self.epoch += 1
            self._epoch_finished = False  # nothing of the next epoch is consumed yet
        if self.end_reason is not None:
            self.log.info(f"training ended after epoch {self.epoch - 1}: {self.end_reason}")
        self.hook.ddpx_train_end(trainer=self)

    def _max_steps_reached(self) -> bool:
        max_steps = self.config.trainer.max_steps
        return max_steps is not None and self.global_step >= max_steps

    def train_epoch(self, epoch: int) -> dict:
        self._epoch_finished = False
        self._losses.start_epoch()
        self.hook.ddpx_epoch_start(trainer=self, epoch=epoch)
        # Resolved after the epoch start: a plugin may attach step hooks there.
        self._callers = callers = step_callers(self.plugin_manager)
        should_step, micro_step = callers["ddpx_should_step"], callers["ddpx_micro_step"]
        optimizer_step, batch_end = callers["ddpx_optimizer_step"], callers["ddpx_batch_end"]
        max_steps = self.config.trainer.max_steps
        self.module.train()
        self.num_batches = len(self.train_loader)
        for batch_index, batch in enumerate(self.train_loader):
            self.batch_index = batch_index
            if self.device.type != "cpu":  # .to() per tensor costs ~10k instructions even on CPU
                batch = to_device(batch, self.device)
            sync = should_step(trainer=self, batch_index=batch_index, num_batches=self.num_batches)
            loss = micro_step(trainer=self, batch=batch, sync=sync)
            stepped = False
            if sync:
                stepped = bool(optimizer_step(trainer=self))
                self.optimizer.zero_grad(set_to_none=True)
                if stepped and self.scheduler is not None:
                    self.scheduler.step()
                self.global_step += 1
            self.last_loss = loss
            self._losses.append(loss)  # summed when read: no per-step host sync
            if batch_end is not None:
                batch_end(trainer=self, batch_index=batch_index, loss=loss, stepped=stepped)
            if sync and self.global_step >= self._next_due:
                self._run_due()
            if self.stop_requested:
                raise TrainingStopped(self._stop_signal)
            if sync and max_steps is not None and self.global_step >= max_steps:
                break
        # Finished unless max_steps cut it short before the epoch's last batch.
        self._epoch_finished = self.epoch_batches >= self.num_batches

        metrics: dict = {"epoch": epoch, "step": self.global_step, **self._epoch_train_loss()}
        if not math.isfinite(metrics.get("loss", 0.0)):
            self.nonfinite_loss(f"in epoch {epoch} (its mean training loss is {metrics['loss']})")
        every = self.config.trainer.eval_every_epochs
        last = epoch + 1 >= self.config.trainer.epochs or self._max_steps_reached()
        if self.eval_loader is not None and every and ((epoch + 1) % every == 0 or last):
            for key, value in self.evaluate().items():
                metrics[key if key not in metrics else f"eval_{key}"] = value
        self.metrics.append(metrics)
        self.hook.ddpx_epoch_end(trainer=self, epoch=epoch, metrics=metrics)
        return metrics

    def _epoch_train_loss(self) -> dict:
        """``{"loss": mean micro-batch loss of the epoch over all ranks}`` (empty if
        no rank trained a batch): one all_reduce per epoch."""
        loss_sum, batches = self._losses.epoch_total()
        if loss_sum is None:
            loss_sum = torch.zeros((), dtype=torch.float64)
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

    def nonfinite_loss(self, where: str, by_step_skipper: bool = False) -> None:
        """The loss went non-finite ``where`` (e.g. "in epoch 3"): act on
        ``trainer.nonfinite``. Called on every rank at the same boundary, from
        all-reduced values only: ``stop`` raises :class:`TrainingDiverged`
        everywhere; ``warn`` logs a warning (rank 0) and goes on. Ignored while
        ``skips_nonfinite_steps`` unless the plugin that skips steps calls it
        (``by_step_skipper``: its skips no longer help)."""
        if self.skips_nonfinite_steps and not by_step_skipper:
            return  # fp16 AMP skipped those steps; it reports a scale that collapses itself
        if self.config.trainer.nonfinite == "warn":
            self._warn_once_per_epoch("loss", f"the loss went non-finite {where}; going on (trainer.nonfinite=warn)")
            return
        raise TrainingDiverged(f"the loss went non-finite {where}; {self._finite_checkpoint_advice()}")

    def nonfinite_weights(self, where: str) -> None:
        """The weights or optimizer state are non-finite ``where`` (the checkpoint
        plugin checks before every save, which it then skips): as :meth:`nonfinite_loss`."""
        if self.config.trainer.nonfinite == "warn":
            self._warn_once_per_epoch("weights", f"the weights are non-finite {where}: no checkpoint written "
                                      "(trainer.nonfinite=warn)")
            return
        raise TrainingDiverged(f"the weights went non-finite {where}; {self._finite_checkpoint_advice()}")

    def _warn_once_per_epoch(self, kind: str, message: str) -> None:
        if self._nonfinite_warned.get(kind) != self.epoch:
            self._nonfinite_warned[kind] = self.epoch
            self.log.warning(message)

    def _finite_checkpoint_advice(self) -> str:
        if self.last_finite_checkpoint is None:
            found = "no checkpoint with finite weights exists"
        else:
            found = f"newest checkpoint with finite weights: {self.last_finite_checkpoint} (a rerun resumes from it)"
        return (f"{found}; automatic restarts (--max-restarts) end at once, as they would diverge again: "
                "lower optimizer.args.lr, set trainer.grad_clip or fix the data, then run again "
                "(trainer.nonfinite=warn goes on instead)")

    def evaluate(self, loader: Optional[DataLoader] = None) -> dict:
        """Metrics on ``loader`` (default: the eval loader), reduced over all ranks."""
        return self.hook.ddpx_evaluate(trainer=self, loader=loader or self.eval_loader) or {}

    def clip_gradients(self) -> Optional[torch.Tensor]:
        """Clip the gradient norm to ``trainer.grad_clip`` (no-op when null); returns the norm."""
        max_norm = self._grad_clip
        if not max_norm:
            return None
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)

    # --- checkpoints -------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything a checkpoint holds: every plugin's ``ddpx_state_dict`` entries, merged."""
        state: dict = {}
        for part in reversed(self.hook.ddpx_state_dict(trainer=self)):  # registration order
            if part:
                state.update(part)
        return state

    def load_state_dict(self, state: dict) -> None:
        self.hook.ddpx_load_state_dict(trainer=self, state=state)

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """Stop at the next batch boundary. Every rank must call it at the same step
        (the checkpoint plugin agrees on that with one all_reduce)."""
        self.stop_requested = True
        self._stop_signal = signum

    # --- scheduled calls and loss windows ------------------------------------------------

    def call_at_step(self, step: int, callback) -> None:
        """Call ``callback(trainer)`` once, at the first optimizer-step boundary with
        ``global_step >= step``, after that micro-batch's ``ddpx_batch_end``
        hooks. Calls due at the same boundary run in the order they were
        scheduled; a call scheduled while those run, for a step already
        reached, runs at the next boundary. The loop pays one integer
        comparison per step for this, however many calls wait.

        A callback that communicates must be scheduled for the same steps, in
        the same order, on every rank (compute the steps from the config,
        ``global_step`` and all-reduced values only).
        """
        heapq.heappush(self._due, (int(step), next(self._due_order), callback))
        self._next_due = self._due[0][0]

    def _run_due(self) -> None:
        step, due = self.global_step, []
        while self._due and self._due[0][0] <= step:
            due.append(heapq.heappop(self._due)[2])
        self._next_due = self._due[0][0] if self._due else NEVER
        tracing = getattr(self.plugin_manager, "ddpx_tracing", False)
        for callback in due:
            if tracing:
                name = getattr(callback, "__qualname__", repr(callback))
                print(f"{rank_prefix()}call at step {step}: {callback.__module__}.{name}", file=sys.stderr,
                      flush=True)
            callback(self)

    def open_loss_window(self) -> LossWindow:
        """A :class:`~ddpx.losses.LossWindow` over the micro-batch losses from now
        on (the logging plugin's step lines and the checkpoint plugin's non-finite
        check use one)."""
        return self._losses.open_window()


class CorePlugin:
    """Default bodies of the provider and wrapper hooks (registered ``trylast`` as "core")."""

    @hookimpl(trylast=True)
    def ddpx_build_model(self, trainer: Trainer):
        return instantiate(trainer.config.model, "model")

    @hookimpl(trylast=True)
    def ddpx_wrap_model(self, trainer: Trainer, model: torch.nn.Module):
        device_ids = [trainer.device] if trainer.device.type == "cuda" else None
        options = ddp_options(trainer.config, trainer.hook.ddpx_ddp_options(trainer=trainer))
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids, **options)

    @hookimpl(trylast=True)
    def ddpx_build_dataloaders(self, trainer: Trainer, train_set, eval_set):
        # Unsharded: every rank sees all data, in the same seeded order (the
        # sampler plugin shards it).
        cfg = trainer.config.trainer
        common = {"num_workers": cfg.num_workers, "pin_memory": trainer.device.type == "cuda"}
        generator = torch.Generator().manual_seed(trainer.config.seed)
        train = DataLoader(train_set, batch_size=cfg.batch_size, shuffle=True, generator=generator, **common)
        evaluation = None
        if eval_set is not None:
            evaluation = DataLoader(eval_set, batch_size=cfg.eval_batch_size, shuffle=False, **common)
        return train, evaluation

    @hookimpl(trylast=True)
    def ddpx_should_step(self, trainer: Trainer, batch_index: int, num_batches: int):
        return True

    @hookimpl(trylast=True)
    def ddpx_micro_step(self, trainer: Trainer, batch, sync: bool):
        callers = trainer._callers or step_callers(trainer.plugin_manager)  # resolved once per epoch in the loop
        loss = callers["ddpx_forward"](trainer=trainer, batch=batch)
        callers["ddpx_backward"](trainer=trainer, loss=loss)
        return loss.detach()

    @hookimpl(trylast=True)
    def ddpx_forward(self, trainer: Trainer, batch):
        return model_loss(trainer.model, trainer.loss_fn, batch)[0]

    @hookimpl(trylast=True)
    def ddpx_backward(self, trainer: Trainer, loss: torch.Tensor):
        loss.backward()
        return True

    @hookimpl(trylast=True)
    def ddpx_optimizer_step(self, trainer: Trainer):
        trainer.clip_gradients()
        trainer.optimizer.step()
        return True

    @hookimpl(trylast=True)
    def ddpx_evaluate(self, trainer: Trainer, loader: DataLoader):
        # Sums (loss * n, correct, n, ...) are all-reduced, so sharded evaluation
        # without padding gives exact metrics. Assumes a mean-reducing loss.
        # Accuracy is built in for class logits and labels; trainer.eval_metric
        # replaces it with the user's metrics (batch means, weighted by n).
        model = trainer.module
        name = trainer.config.trainer.eval_metric
        metric = resolve(name, "trainer.eval_metric") if name else None
        was_training = model.training
        model.eval()
        # (loss * n, correct, n, batches with class labels)
        sums = torch.zeros(4, dtype=torch.float64, device=trainer.device)
        metric_sums: dict = {}
        with torch.no_grad():
            for batch in loader:
                batch = to_device(batch, trainer.device)
                loss, outputs, targets = model_loss(model, trainer.loss_fn, batch)
                n = batch_size(batch, targets)
                sums[0] += loss.double() * n
                sums[2] += n
                if metric is not None:
                    for key, value in metric(outputs, batch).items():
                        metric_sums[key] = metric_sums.get(key, 0.0) + torch.as_tensor(value, dtype=torch.float64,
                                                                                       device=trainer.device) * n
                elif (isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor) and outputs.dim() == 2
                      and targets.dim() == 1 and not targets.is_floating_point()):
                    sums[3] += 1
                    sums[1] += (outputs.argmax(dim=1) == targets).sum()
        model.train(was_training)
        if metric is not None:
            # A rank may have had no batch to learn the names from: agree on them first.
            names: list = [None] * trainer.world_size
            dist.all_gather_object(names, sorted(metric_sums))
            keys = sorted(set().union(*names))
            sums = torch.cat([sums, torch.stack([metric_sums.get(k, sums.new_zeros(())) for k in keys])]) if keys else sums
        dist.all_reduce(sums)
        loss_sum, correct, count, classified = sums[:4].tolist()
        if count == 0:
            return {}
        metrics = {"loss": loss_sum / count}
        if classified:
            metrics["accuracy"] = correct / count
        if metric is not None:
            metrics.update({key: value / count for key, value in zip(keys, sums[4:].tolist())})
        return metrics

    @hookimpl(trylast=True)
    def ddpx_state_dict(self, trainer: Trainer):
        progress = {
            # The epoch to resume in: the next one once this epoch's batches are done.
            "epoch": trainer.epoch + (1 if trainer._epoch_finished else 0),
            "global_step": trainer.global_step,
        }
        state = {"model": trainer.module.state_dict(), "optimizer": trainer.optimizer.state_dict(), "progress": progress}
        if trainer.scheduler is not None:
            state["scheduler"] = trainer.scheduler.state_dict()
        return state

    @hookimpl(trylast=True)
    def ddpx_load_state_dict(self, trainer: Trainer, state):
        if "model" in state:
            trainer.module.load_state_dict(state["model"])
        if "optimizer" in state:
            trainer.optimizer.load_state_dict(state["optimizer"])
        if "scheduler" in state and trainer.scheduler is not None:
            trainer.scheduler.load_state_dict(state["scheduler"])
        if "progress" in state:
            trainer.epoch = int(state["progress"]["epoch"])
            trainer.global_step = int(state["progress"]["global_step"])

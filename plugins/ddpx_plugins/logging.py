"""Progress bar, rank-aware log messages and ``metrics.jsonl``.

* Rank 0 shows a tqdm progress bar (one for the whole run, labelled with the
  epoch) with the training loss (rank 0's mean micro-batch loss since the
  previous redraw, read from a loss window of its own at the redraw, about
  every ``BAR_SECONDS``) and the throughput in samples/s (all ranks together:
  ``world_size * batch_size`` per micro-batch, from the latest step line).
* Log messages of the ``ddpx`` logger (``trainer.log``) carry a rank prefix
  (``[rank1] ...``); by default only rank 0's info messages are shown (warnings
  and errors of every rank always are); ``all_ranks: true`` shows every rank's.
* Rank 0 appends one JSON line to ``<run_dir>/<metrics_file>`` every
  ``every_steps`` optimizer steps (``kind: "step"``: ``step``, ``epoch``, ``loss``
  = rank 0's mean micro-batch loss since the previous line, ``lr``,
  ``samples_per_s``, ``time``) and one per epoch (``kind: "epoch"``: ``step``,
  ``epoch`` and the epoch's metrics, e.g. ``loss``, ``accuracy``). The
  micro-batch losses come from a loss window of the trainer
  (``trainer.open_loss_window``): device tensors, summed and read (one
  ``.item()``) only on logged steps.
* ``tensorboard: true`` (the extra ``ddpx[tensorboard]``): rank 0 also writes
  ``<run_dir>/tensorboard`` through ``torch.utils.tensorboard``: at each step
  line ``train/loss``, ``train/lr``, ``train/samples_per_s``, ``train/amp_scale``
  (fp16), ``comm/compression`` and ``comm/wire_bytes_per_step`` (the comm
  hook's counters, this rank's sent bytes per optimizer step); at each epoch end
  ``epoch/<metric>`` for every number in the epoch's metrics (``loss``,
  ``eval_loss``, ``accuracy``, ...). The x axis is the optimizer step.
* Nothing runs per step: on rank 0, when there is a bar or step lines, the
  plugin is called (``trainer.call_at_step``) at logged steps and, for the
  bar, about every ``BAR_SECONDS`` (the number of steps adapts to the step
  time); the bar also advances at the epoch end.

Config section ``logging``: ``progress`` (true), ``all_ranks`` (false),
``every_steps`` (50, as Lightning's ``log_every_n_steps``; 0 writes only
per-epoch lines), ``metrics_file`` (``metrics.jsonl``; relative to the run
directory), ``tensorboard`` (false).

Per-run state lives in ``trainer.logging`` (a :class:`MetricsLog`; docs/plugins.md, "Per-run state").
"""

import json
import logging
import math
import os
import sys
import time

from ddpx import hookimpl
from ddpx.errors import DdpxError
from ddpx.plugin import rank_prefix

LOGGER = "ddpx"
FLUSH_EVERY_S = 1.0  # step lines: a flush (a system call) at most this often
BAR_SECONDS = 0.1  # the bar advances about this often (tqdm redraws at most every 0.1 s anyway)
MAX_BAR_STEPS = 1000  # and at least every this many optimizer steps


class _RankFilter(logging.Filter):
    """Adds the rank prefix; drops other ranks' info/debug messages unless all ranks are wanted."""

    def __init__(self, rank, all_ranks):
        super().__init__()
        self.rank = rank
        self.all_ranks = all_ranks
        self.prefix = rank_prefix()

    def filter(self, record):
        record.rank_prefix = self.prefix
        return self.all_ranks or self.rank == 0 or record.levelno >= logging.WARNING


class _TqdmHandler(logging.Handler):
    """Writes through ``tqdm.write`` so messages do not tear the progress bar."""

    def emit(self, record):
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def configure_logger(rank, all_ranks, level=logging.INFO):
    """Route the ``ddpx`` logger through one rank-aware handler (replacing an earlier one)."""
    logger = logging.getLogger(LOGGER)
    for handler in list(logger.handlers):
        if isinstance(handler, _TqdmHandler):
            logger.removeHandler(handler)
    handler = _TqdmHandler()
    handler.addFilter(_RankFilter(rank, all_ranks))
    handler.setFormatter(logging.Formatter("%(rank_prefix)s%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # one line per message, even if the root logger has handlers
    return logger


class MetricsLog:
    """What one run of the logging plugin holds. Rank 0 shows the bar and writes
    the file; other ranks do nothing per step."""

    def __init__(self, path, every_steps, progress, samples_per_batch):
        self.path = path
        self.every_steps = every_steps
        self.progress = progress
        self.samples_per_batch = samples_per_batch
        self.file = None
        self.tensorboard = None  # rank 0's SummaryWriter with logging.tensorboard
        self.comm_counted = (0, 0)  # (wire bytes, steps) of the comm hook at the last step line
        self.bar = None
        self.window = None  # the trainer's LossWindow since the last step line (rank 0)
        self.bar_window = None  # and the one since the bar's last redraw
        self.postfix = {}  # the bar's loss and samples/s
        self.bar_shown = 0  # micro-batches of the window already shown on the bar
        self.epoch_base = 0  # micro-batches of the window from before this epoch: not in the throughput
        self.bar_steps = 1  # optimizer steps between bar updates, adapted to the step time
        self.last_call = (0, 0.0)  # (global_step, perf_counter) of the last scheduled call
        self.flushed = 0.0  # perf_counter of the last flush of the metrics file
        self.mark = time.perf_counter()  # start of the throughput's time span
        self.start = self.mark

    def write(self, record, flush=True):
        if self.file is None:
            return
        self.file.write(json.dumps(record, default=_plain) + "\n")
        now = time.perf_counter()
        if flush or now - self.flushed >= FLUSH_EVERY_S:
            self.file.flush()
            self.flushed = now

    def start_bar(self, epoch, batches_left):
        """One bar for the whole run, as the Hugging Face Trainer shows (a tqdm per
        epoch costs about 100 us to build and draw, which short epochs feel). Its
        total is re-estimated at each epoch start: the batches done plus this
        epoch's batches times the epochs left."""
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=batches_left, desc=f"epoch {epoch}", unit="batch", file=sys.stderr,
                            dynamic_ncols=True)
        else:
            self.bar.total = None if batches_left is None else self.bar.n + batches_left
            self.bar.set_description(f"epoch {epoch}", refresh=False)

    def advance_bar(self):
        if self.bar is not None and self.window is not None:
            loss_sum, count = self.bar_window.take()
            if count:  # one host read per redraw, none per step
                self.postfix["loss"] = f"{loss_sum.item() / count:.4f}"
                self.bar.set_postfix(self.postfix, refresh=False)
            pending = self.window.pending
            if pending > self.bar_shown:
                self.bar.update(pending - self.bar_shown)
            self.bar_shown = pending

    # --- scheduled on rank 0: nothing per step -------------------------------------------

    def schedule(self, trainer):
        step = trainer.global_step
        due = step + self.bar_steps if self.progress else None
        if self.every_steps:
            line = (step // self.every_steps + 1) * self.every_steps
            due = line if due is None else min(due, line)
            trainer.watch_grad_norm(line)  # that step's gradient norm, computed then (every step with grad_clip)
        if due is not None:
            trainer.call_at_step(due, self.at_step)

    def at_step(self, trainer):
        now, step = time.perf_counter(), trainer.global_step
        last_step, last_time = self.last_call
        self.last_call = (step, now)
        if self.bar is not None:
            self.advance_bar()
            step_s = (now - last_time) / max(1, step - last_step)
            self.bar_steps = max(1, min(MAX_BAR_STEPS, int(BAR_SECONDS / max(step_s, 1e-9))))
        if self.every_steps and step % self.every_steps == 0:
            self.write_step_line(trainer, now)
        self.schedule(trainer)

    def write_step_line(self, trainer, now):
        loss_sum, count = self.window.take()
        self.bar_shown = 0
        batches, self.epoch_base = count - self.epoch_base, 0
        mean_loss = loss_sum.item() / count if count else math.nan  # the only host sync, every every_steps steps
        samples_per_s = batches * self.samples_per_batch / max(now - self.mark, 1e-9)
        self.mark = now
        record = {
            "kind": "step",
            "step": trainer.global_step,
            "epoch": trainer.epoch,
            "loss": mean_loss,
            "lr": trainer.optimizer.param_groups[0]["lr"],
            "samples_per_s": samples_per_s,
            "time": now - self.start,
        }
        if trainer.grad_norm_step == trainer.global_step:
            record["grad_norm"] = trainer.grad_norm.item()
        self.write(record, flush=False)  # flushed at most once a second, and with every epoch line
        if self.tensorboard is not None:
            self.add_scalars("train", record, trainer.global_step)
            self.add_training_state(trainer)
        if self.bar is not None:
            self.postfix["samples_s"] = f"{samples_per_s:.0f}"
            self.bar.set_postfix(self.postfix, refresh=False)

    def add_scalars(self, prefix, values, step):
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("step", "epoch", "time"):
                self.tensorboard.add_scalar(f"{prefix}/{key}", value, step)

    def add_training_state(self, trainer):
        """The AMP scale and the comm hook's compression, read at step lines only."""
        step = trainer.global_step
        amp = getattr(trainer, "amp", None)
        if amp is not None and amp.scaler is not None:
            self.tensorboard.add_scalar("train/amp_scale", amp.scaler.get_scale(), step)
        hook = getattr(trainer, "comm_hook", None)
        if hook is not None and hasattr(hook, "stats"):
            stats = hook.stats()
            wire, steps = self.comm_counted
            if stats["steps"] > steps:
                self.tensorboard.add_scalar("comm/wire_bytes_per_step", (stats["wire_bytes"] - wire) /
                                            (stats["steps"] - steps), step)
            if stats["compression"] is not None:
                self.tensorboard.add_scalar("comm/compression", stats["compression"], step)
            self.comm_counted = (stats["wire_bytes"], stats["steps"])

    def close(self):
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.bar is not None:
            self.advance_bar()
            self.bar.close()
            self.bar = None
        if self.file is not None:
            self.file.close()
            self.file = None


def _plain(value):
    """JSON for tensors and numpy scalars in metrics."""
    if hasattr(value, "item"):
        return value.item()
    return str(value)


@hookimpl
def ddpx_config_defaults():
    return {"logging": {"progress": True, "all_ranks": False, "every_steps": 50, "metrics_file": "metrics.jsonl",
                        "tensorboard": False}}


@hookimpl
def ddpx_configure(config):
    cfg = config.section("logging")
    if cfg["every_steps"] < 0:
        raise DdpxError(f"logging.every_steps must be 0 (epoch lines only) or more (got {cfg['every_steps']})")
    if not cfg["metrics_file"]:
        raise DdpxError("logging.metrics_file must name a file (e.g. metrics.jsonl)")
    if cfg["tensorboard"]:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            raise DdpxError("logging.tensorboard needs the tensorboard package: pip install 'ddpx[tensorboard]' "
                            "(or set logging.tensorboard=false)") from None


@hookimpl(tryfirst=True)  # before other plugins log from their setup hooks
def ddpx_setup(trainer):
    cfg = trainer.config.section("logging")
    configure_logger(trainer.rank, cfg["all_ranks"])
    path = os.path.join(str(trainer.run_dir), cfg["metrics_file"])
    samples_per_batch = trainer.world_size * trainer.config.trainer.batch_size
    trainer.logging = MetricsLog(path, cfg["every_steps"], cfg["progress"], samples_per_batch)


@hookimpl
def ddpx_train_start(trainer):
    log = trainer.logging
    log.start = log.mark = time.perf_counter()
    if trainer.rank != 0:
        return
    os.makedirs(os.path.dirname(log.path) or ".", exist_ok=True)
    log.file = open(log.path, "a")  # a resumed run continues the same file
    if trainer.config.section("logging")["tensorboard"]:
        from torch.utils.tensorboard import SummaryWriter

        log.tensorboard = SummaryWriter(os.path.join(str(trainer.run_dir), "tensorboard"))
    if log.progress or log.every_steps > 0:
        log.window = trainer.open_loss_window()
        if log.progress:
            log.bar_window = trainer.open_loss_window()
        log.last_call = (trainer.global_step, log.start)
        log.schedule(trainer)


@hookimpl(trylast=True)  # after the sampler has set the epoch: len(train_loader) is this epoch's
def ddpx_epoch_start(trainer, epoch):
    log = trainer.logging
    log.mark = time.perf_counter()
    if log.window is None:
        return
    log.epoch_base = log.window.pending
    # The bar's step time is measured within epochs: evaluation (or anything
    # else between epochs) would make it look slow and the bar update every step.
    log.last_call = (trainer.global_step, log.mark)
    if log.progress:
        epochs_left = trainer.config.trainer.epochs - epoch
        has_len = hasattr(trainer.train_loader, "__len__")
        log.start_bar(epoch, len(trainer.train_loader) * epochs_left if has_len else None)


@hookimpl(trylast=True)  # after other plugins added their entries to ``metrics``
def ddpx_epoch_end(trainer, epoch, metrics):
    log = trainer.logging
    if trainer.rank != 0:
        return
    log.advance_bar()
    log.write({"kind": "epoch", "step": trainer.global_step, "epoch": epoch, **metrics})
    if log.tensorboard is not None:
        log.add_scalars("epoch", metrics, trainer.global_step)
        log.tensorboard.flush()
    shown = "  ".join(f"{k} {_format(v)}" for k, v in metrics.items() if k not in ("epoch", "step"))
    trainer.log.info("epoch %d (step %d): %s", epoch, trainer.global_step, shown)


def _format(value):
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.4g}"
    return str(value)


@hookimpl
def ddpx_train_end(trainer):
    trainer.logging.close()


@hookimpl
def ddpx_exception(trainer, exc):
    log = getattr(trainer, "logging", None)
    if log is not None:
        log.close()

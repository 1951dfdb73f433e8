"""Progress bar, rank-aware log messages and ``metrics.jsonl``.

* Rank 0 shows a tqdm progress bar (one for the whole run, labelled with the
  epoch) with the training loss and the throughput in samples/s (all ranks
  together: ``world_size * batch_size`` per micro-batch).
* Log messages of the ``ddpx`` logger (``trainer.log``) carry a rank prefix
  (``[rank1] ...``); by default only rank 0's info messages are shown (warnings
  and errors of every rank always are); ``all_ranks: true`` shows every rank's.
* Rank 0 appends one JSON line to ``<run_dir>/<metrics_file>`` every
  ``every_steps`` optimizer steps (``kind: "step"``: ``step``, ``epoch``, ``loss``
  = rank 0's mean micro-batch loss since the previous line, ``lr``,
  ``samples_per_s``, ``time``) and one per epoch (``kind: "epoch"``: ``step``,
  ``epoch`` and the epoch's metrics, e.g. ``loss``, ``accuracy``). The
  micro-batch losses are kept as device tensors and summed and read (one
  ``.item()``) only on logged steps.
* The per-step hook is attached on rank 0 only, when there is a bar or step
  lines; the bar advances every ``BAR_EVERY`` batches (and at logged steps and
  the epoch end).

Config section ``logging``: ``progress`` (true), ``all_ranks`` (false),
``every_steps`` (50, as Lightning's ``log_every_n_steps``; 0 writes only
per-epoch lines), ``metrics_file`` (``metrics.jsonl``; relative to the run
directory).

Per-run state lives in ``trainer.metrics_log`` (a :class:`MetricsLog`).
"""

import json
import logging
import math
import os
import sys
import time

from ddpx import hookimpl
from ddpx.errors import DdpxError
from ddpx.plugin import attach, rank_prefix

LOGGER = "ddpx"
FLUSH_EVERY_S = 1.0  # step lines: a flush (a system call) at most this often
BAR_EVERY = 16  # batches per progress-bar update: tqdm's bookkeeping is not free every step


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
    """What one run of the logging plugin holds (rank 0 writes, other ranks only count)."""

    def __init__(self, path, every_steps, progress, samples_per_batch):
        self.path = path
        self.every_steps = every_steps
        self.progress = progress
        self.samples_per_batch = samples_per_batch
        self.file = None
        self.bar = None
        self.losses = []  # micro-batch losses since the last step line: stacked (one kernel) when logged
        self.bar_pending = 0  # batches not yet shown on the bar
        self.flushed = 0.0  # perf_counter of the last flush of the metrics file
        self.batches = 0
        self.mark = time.perf_counter()
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

    def flush_bar(self):
        if self.bar_pending:
            self.bar.update(self.bar_pending)
            self.bar_pending = 0

    def close(self):
        if self.bar is not None:
            self.flush_bar()
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
    return {"logging": {"progress": True, "all_ranks": False, "every_steps": 50, "metrics_file": "metrics.jsonl"}}


@hookimpl
def ddpx_configure(config):
    cfg = config.section("logging")
    if cfg["every_steps"] < 0:
        raise DdpxError(f"logging.every_steps must be 0 (epoch lines only) or more (got {cfg['every_steps']})")
    if not cfg["metrics_file"]:
        raise DdpxError("logging.metrics_file must name a file (e.g. metrics.jsonl)")


@hookimpl(tryfirst=True)  # before other plugins log from their setup hooks
def ddpx_setup(trainer):
    cfg = trainer.config.section("logging")
    configure_logger(trainer.rank, cfg["all_ranks"])
    path = os.path.join(str(trainer.run_dir), cfg["metrics_file"])
    samples_per_batch = trainer.world_size * trainer.config.trainer.batch_size
    trainer.metrics_log = MetricsLog(path, cfg["every_steps"], cfg["progress"], samples_per_batch)
    if trainer.rank == 0 and (cfg["progress"] or cfg["every_steps"] > 0):
        attach(trainer.plugin_manager, StepLog(trainer.metrics_log), "logging.steps")


@hookimpl
def ddpx_train_start(trainer):
    log = trainer.metrics_log
    if trainer.rank == 0:
        os.makedirs(os.path.dirname(log.path) or ".", exist_ok=True)
        log.file = open(log.path, "a")  # a resumed run continues the same file
    log.start = time.perf_counter()


@hookimpl(trylast=True)  # after the sampler has set the epoch: len(train_loader) is this epoch's
def ddpx_epoch_start(trainer, epoch):
    log = trainer.metrics_log
    log.mark = time.perf_counter()
    log.batches = 0
    log.bar_pending = 0
    if trainer.rank == 0 and log.progress:
        epochs_left = trainer.config.trainer.epochs - epoch
        has_len = hasattr(trainer.train_loader, "__len__")
        log.start_bar(epoch, len(trainer.train_loader) * epochs_left if has_len else None)


class StepLog:
    """The per-step hook, attached on rank 0 only, and only when there is a progress
    bar or step lines (other ranks and ``progress: false, every_steps: 0`` do
    nothing per step)."""

    def __init__(self, log):
        self.log = log

    @hookimpl
    def ddpx_batch_end(self, trainer, batch_index, loss, stepped):
        log = self.log
        log.batches += 1
        if log.bar is not None:
            log.bar_pending += 1
            if log.bar_pending >= BAR_EVERY:
                log.flush_bar()
        if log.every_steps == 0:
            return
        log.losses.append(loss.detach() if loss.requires_grad else loss)
        if not stepped or trainer.global_step % log.every_steps != 0:
            return
        import torch

        now = time.perf_counter()
        mean_loss = torch.stack(log.losses).sum().item() / len(log.losses)  # the only host sync, every every_steps steps
        samples_per_s = log.batches * log.samples_per_batch / max(now - log.mark, 1e-9)
        log.losses = []
        log.mark, log.batches = now, 0
        record = {
            "kind": "step",
            "step": trainer.global_step,
            "epoch": trainer.epoch,
            "loss": mean_loss,
            "lr": trainer.optimizer.param_groups[0]["lr"],
            "samples_per_s": samples_per_s,
            "time": now - log.start,
        }
        log.write(record, flush=False)  # flushed at most once a second, and with every epoch line
        if log.bar is not None:
            log.flush_bar()
            log.bar.set_postfix(loss=f"{mean_loss:.4f}", samples_s=f"{samples_per_s:.0f}", refresh=False)


@hookimpl(trylast=True)  # after other plugins added their entries to ``metrics``
def ddpx_epoch_end(trainer, epoch, metrics):
    log = trainer.metrics_log
    if trainer.rank != 0:
        return
    if log.bar is not None:
        log.flush_bar()
    log.write({"kind": "epoch", "step": trainer.global_step, "epoch": epoch, **metrics})
    shown = "  ".join(f"{k} {_format(v)}" for k, v in metrics.items() if k not in ("epoch", "step"))
    trainer.log.info("epoch %d (step %d): %s", epoch, trainer.global_step, shown)


def _format(value):
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.4g}"
    return str(value)


@hookimpl
def ddpx_train_end(trainer):
    trainer.metrics_log.close()


@hookimpl
def ddpx_exception(trainer, exc):
    log = getattr(trainer, "metrics_log", None)
    if log is not None:
        log.close()

"""Progress bar, rank-aware log messages and ``metrics.jsonl``.

* On a terminal rank 0 shows a tqdm progress bar (one for the whole run, labelled with the
  epoch; elsewhere a plain line about every ``progress.LINE_SECONDS``) with the training loss (rank 0's mean micro-batch loss since the
  previous redraw, read from a loss window of its own at the redraw, about
  every ``progress.BAR_SECONDS``) and the throughput in samples/s (all ranks together:
  ``world_size * batch_size`` per micro-batch, from the latest step line). It counts
  micro-batches to the end of ``trainer.epochs``, or of ``trainer.max_steps`` where that
  comes first (re-estimated at each epoch start). Rank 0 logs one line per epoch (its
  metrics; with a comm hook the bytes sent per step against an fp32 allreduce's), and at a
  normal end one summary line: the training time, the last epoch's metrics, the run directory.
* The trackers' settings are checked in the launcher (``ddpx_configure``): a setting without
  the key that turns its tracker on, and an MLflow ``tracking_uri`` the installed MLflow refuses.
* Log messages of the ``ddpx`` logger (``trainer.log``) carry a rank prefix
  (``[rank1] ...``); by default only rank 0's messages at ``level`` and above are shown
  (warnings and errors of every rank always are); ``all_ranks: true`` shows every rank's.
  The same lines go to ``<run_dir>/console.log``.
* Rank 0 appends one JSON line to ``<run_dir>/<metrics_file>`` every
  ``every_steps`` optimizer steps (``kind: "step"``: ``step``, ``epoch``, ``loss``
  = rank 0's mean micro-batch loss since the previous line, ``lr``,
  ``samples_per_s``, ``time``) and one per epoch (``kind: "epoch"``: ``step``,
  ``epoch`` and the epoch's metrics, e.g. ``loss``, ``accuracy``). The
  micro-batch losses come from a loss window of the trainer
  (``trainer.open_loss_window``): device tensors, summed and read (one
  ``.item()``) only on logged steps.
* Every step line also carries ``grad_norm`` (the total gradient norm of that
  step: ``trainer.watch_grad_norm``), ``amp_scale`` (fp16), and the comm hook's
  ``comm_wire_bytes_per_step`` (this rank's sent bytes per optimizer step since
  the previous line) and ``comm_compression``.
* The same records go to every backend (:class:`trackers.Backend`: log the resolved
  config once, log metrics at a step, log a file, close), all on rank 0:
  ``metrics.jsonl`` always; ``tensorboard: true`` (``ddpx[tensorboard]``):
  ``<run_dir>/tensorboard``; ``wandb.project`` set (``ddpx[wandb]``): a Weights
  & Biases run; ``mlflow.experiment`` set (``ddpx[mlflow]``): an MLflow run.
  Scalar names there: ``train/<key>`` for step lines (``comm/<key>`` for the
  comm hook's), ``epoch/<metric>`` for epoch lines; the x axis is the
  optimizer step. W&B and MLflow runs are resumed (the run id is kept in the
  run directory), and get ``metrics.jsonl``, the final checkpoint, the EMA weights and ``model/`` as files.
* Nothing runs per step: on rank 0, when there is a bar or step lines, the
  plugin is called (``trainer.call_at_step``) at logged steps and, for the
  bar, about every ``progress.BAR_SECONDS`` (the number of steps adapts to the step
  time); the bar also advances at the epoch end.

Config section ``logging``: ``progress`` (true), ``level`` (``info``; ``warning``,
``debug``), ``all_ranks`` (false),
``every_steps`` (50, as Lightning's ``log_every_n_steps``; 0 writes only
per-epoch lines), ``metrics_file`` (``metrics.jsonl``; relative to the run
directory), ``tensorboard`` (false), ``wandb`` (``project``, ``entity``,
``name``, ``tags``, ``mode``), ``mlflow`` (``tracking_uri``, ``experiment``,
``run_name``).

Per-run state: ``trainer.plugin("logging").state`` (a :class:`metrics_log.MetricsLog`; docs/plugins.md, "Per-run state").

This module is the plugin (its config section and hooks); ``console``: the logger set-up,
``progress``: the bar, ``metrics_log``: the run's records, ``trackers``: the backends.
"""

import importlib.util
import math
import os
import time

from ddpx import hookimpl
from ddpx.errors import DdpxError
from ddpx.plugin.shared import ACCUMULATION_STEPS

from .console import LEVELS, configure_logger
from .metrics_log import MetricsLog
from .progress import clear_line_before_mine
from .trackers import open_backends, wanted_backends

__all__ = ["LoggingPlugin"]

EXTRAS = {  # config key -> (import name, extra)
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}


TURN_OFF = {"tensorboard": "tensorboard=false", "wandb": "wandb.project=null", "mlflow": "mlflow.experiment=null"}
SWITCHES = {"wandb": "project", "mlflow": "experiment"}  # the key that turns a tracker on


def check_tracker_switches(cfg):
    """A tracker's settings without the key that turns it on would be silently ignored:
    ``logging.mlflow.tracking_uri`` without ``logging.mlflow.experiment`` logs nothing."""
    for tracker, switch in SWITCHES.items():
        section = cfg[tracker]
        if section[switch] is not None:
            continue
        given = [key for key, value in section.items() if value not in (None, [], "")]
        if given:
            raise DdpxError(f"logging.{tracker}.{given[0]} is set but logging.{tracker}.{switch} is not, so "
                            f"nothing goes to {tracker}: set logging.{tracker}.{switch}=NAME (or remove "
                            f"logging.{tracker}.{given[0]})")


def check_mlflow_uri(uri):
    """Ask the installed MLflow for the store of ``logging.mlflow.tracking_uri`` (no network:
    an http(s) store connects at its first request), so a URI it refuses (an unknown scheme;
    the file store, in maintenance mode since MLflow 3.13) is one line before any worker starts.
    The default (null: SQLite in the run directory) is not asked (it would make a database), but
    it needs SQLAlchemy and Alembic, which ``mlflow-skinny`` lacks: that is one line too."""
    if uri is None:
        missing = [m for m in ("sqlalchemy", "alembic") if not _importable(m)]
        if missing:
            raise DdpxError(f"logging.mlflow.tracking_uri=null keeps MLflow's runs in a SQLite store in the run "
                            f"directory, which needs {' and '.join(missing)} (not installed: mlflow-skinny lacks "
                            "them); pip install 'ddpx[mlflow]' (the full mlflow), or set "
                            "logging.mlflow.tracking_uri to an http(s) server")
        return
    import mlflow
    from mlflow.tracking import MlflowClient

    try:
        MlflowClient(tracking_uri=uri)
    except Exception as exc:
        text = " ".join(str(exc).split())
        reason = text.split(". ")[0].rstrip(".")
        keep = " or set MLFLOW_ALLOW_FILE_STORE=true to keep the file store," \
            if "MLFLOW_ALLOW_FILE_STORE" in text else ""
        raise DdpxError(f"logging.mlflow.tracking_uri={uri}: MLflow {getattr(mlflow, '__version__', '?')} refuses it "
                        f"({reason}); use a database (sqlite:///PATH/mlflow.db) or an http(s) server,{keep} or set "
                        "logging.mlflow.tracking_uri=null for a SQLite store in the run directory") from None


def _importable(module):
    try:
        if module == "torch.utils.tensorboard":
            import torch.utils.tensorboard  # noqa: F401  (itself checks for the tensorboard package)

            return True
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def _format(value):
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.4g}"
    return str(value)


def batches_left(trainer, epoch):
    """The progress bar's micro-batches from this epoch's start to the end of the run: the
    epochs left, or fewer where ``trainer.max_steps`` ends the run first (its steps left times
    the accumulation's micro-batches per step); for a loader without a length (a stream),
    ``trainer.max_steps``'s batches left, or None without it."""
    from ddpx.data.stream import has_length  # imports torch: not on loading the plugin

    left = None
    if has_length(trainer.train_loader):  # a DataLoader over a stream has __len__, which raises
        left = len(trainer.train_loader) * (trainer.config.trainer.epochs - epoch)
    max_steps = trainer.config.trainer.max_steps
    if max_steps is not None:
        by_steps = max(0, max_steps - trainer.global_step) * trainer.shared.get(ACCUMULATION_STEPS, 1)
        left = by_steps if left is None else min(left, by_steps)
    return left


def run_summary(trainer, seconds):
    """Rank 0's last line of a run that ended normally: how long it took, the last epoch's
    metrics and the run directory."""
    last = trainer.metrics[-1] if trainer.metrics else None
    if last is None:
        shown = "no epoch ended in this run"
    else:
        values = "  ".join(f"{k} {_format(v)}" for k, v in last.items() if k not in ("epoch", "step"))
        shown = f"epoch {last['epoch']}: {values}"
    return (f"finished after {_duration(seconds)} of training (step {trainer.global_step}); {shown}; "
            f"run directory {trainer.run_dir}")


def _duration(seconds):
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    return f"{minutes // 60} h {minutes % 60} min"


class LoggingPlugin:
    """``state``: the run's :class:`MetricsLog` (None before ``ddpx_setup``)."""

    def __init__(self):
        self.state = None

    @hookimpl
    def ddpx_config_defaults(self):
        return {"logging": {"progress": True, "level": "info", "all_ranks": False, "every_steps": 50,
                            "metrics_file": "metrics.jsonl",
                            "tensorboard": False,
                            "wandb": {"project": None, "entity": None, "name": None, "tags": [], "mode": None},
                            "mlflow": {"tracking_uri": None, "experiment": None, "run_name": None}}}

    @hookimpl
    def ddpx_configure(self, config):
        cfg = config.section("logging")
        if cfg["level"] not in LEVELS:
            raise DdpxError(f"logging.level must be one of {', '.join(LEVELS)} (got {cfg['level']!r})")
        if cfg["every_steps"] < 0:
            raise DdpxError(f"logging.every_steps must be 0 (epoch lines only) or more (got {cfg['every_steps']})")
        if not cfg["metrics_file"]:
            raise DdpxError("logging.metrics_file must name a file (e.g. metrics.jsonl)")
        mode = cfg["wandb"]["mode"]
        if mode not in (None, "online", "offline", "disabled"):
            raise DdpxError(f"logging.wandb.mode must be online, offline, disabled or null (got {mode!r})")
        if cfg["wandb"]["project"] is not None and not isinstance(cfg["wandb"]["project"], str):
            raise DdpxError(f"logging.wandb.project must be a project name (got {cfg['wandb']['project']!r})")
        if cfg["mlflow"]["experiment"] is not None and not isinstance(cfg["mlflow"]["experiment"], str):
            raise DdpxError(f"logging.mlflow.experiment must be an experiment name (got {cfg['mlflow']['experiment']!r})")
        check_tracker_switches(cfg)
        for name in wanted_backends(cfg):
            module, extra = EXTRAS[name]
            if not _importable("torch.utils.tensorboard" if name == "tensorboard" else module):
                raise DdpxError(f"logging.{name} needs the {module} package: pip install 'ddpx[{extra}]' "
                                f"(or set logging.{TURN_OFF[name]})")
        if "mlflow" in wanted_backends(cfg) and "RANK" not in os.environ:
            # In the launcher (or a run in this process) only: a check on some ranks of a
            # started group would leave the others waiting for them.
            check_mlflow_uri(cfg["mlflow"]["tracking_uri"])

    @hookimpl(tryfirst=True)  # before other plugins log from their setup hooks
    def ddpx_setup(self, trainer):
        cfg = trainer.config.section("logging")
        configure_logger(trainer.rank, cfg["all_ranks"], LEVELS[cfg["level"]], trainer.run_dir)
        samples_per_batch = trainer.world_size * trainer.config.trainer.batch_size
        self.state = MetricsLog(cfg["every_steps"], cfg["progress"], samples_per_batch)

    @hookimpl
    def ddpx_train_start(self, trainer):
        log = self.state
        log.start = log.mark = time.perf_counter()
        if trainer.rank != 0:
            log.around_bar = clear_line_before_mine(trainer.rank, log.progress)
            return
        log.backends = open_backends(trainer, trainer.config.section("logging"))
        log.count_comm_from_here(trainer)
        if log.progress or log.every_steps > 0:
            log.window = trainer.open_loss_window()
            if log.progress:
                log.bar_window = trainer.open_loss_window()
            log.last_call = (trainer.global_step, log.start)
            log.schedule(trainer)

    @hookimpl(trylast=True)  # after the sampler has set the epoch: len(train_loader) is this epoch's
    def ddpx_epoch_start(self, trainer, epoch):
        log = self.state
        log.mark = time.perf_counter()
        if log.window is None:
            return
        log.epoch_base = log.window.pending
        # The bar's step time is measured within epochs: evaluation (or anything
        # else between epochs) would make it look slow and the bar update every step.
        log.last_call = (trainer.global_step, log.mark)
        if log.progress:
            log.start_bar(epoch, batches_left(trainer, epoch), trainer.log.info)

    @hookimpl(trylast=True)  # after other plugins added their entries to ``metrics``
    def ddpx_epoch_end(self, trainer, epoch, metrics):
        log = self.state
        if trainer.rank != 0:
            return
        log.advance_bar()
        log.log_metrics("epoch", trainer.global_step, {"epoch": epoch, **{k: v for k, v in metrics.items()
                                                                            if k != "step"}})
        shown = "  ".join(f"{k} {_format(v)}" for k, v in metrics.items() if k not in ("epoch", "step"))
        trainer.log.info("epoch %d (step %d): %s%s", epoch, trainer.global_step, shown, log.comm_this_epoch(trainer))

    @hookimpl(wrapper=True)  # around every other plugin's: the final checkpoint is written when it closes
    def ddpx_train_end(self, trainer):
        result = yield
        self.state.close(trainer)
        if trainer.rank == 0:
            trainer.log.info(run_summary(trainer, time.perf_counter() - self.state.start))
        return result

    @hookimpl
    def ddpx_exception(self, trainer, exc):
        log, self.state = self.state, None
        if log is not None:  # None: ddpx_setup did not run
            log.close(failed=True)

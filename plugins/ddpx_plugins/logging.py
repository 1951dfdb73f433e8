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
* Every step line also carries ``grad_norm`` (the total gradient norm of that
  step: ``trainer.watch_grad_norm``), ``amp_scale`` (fp16), and the comm hook's
  ``comm_wire_bytes_per_step`` (this rank's sent bytes per optimizer step since
  the previous line) and ``comm_compression``.
* The same records go to every backend (:class:`Backend`: log the resolved
  config once, log metrics at a step, log a file, close), all on rank 0:
  ``metrics.jsonl`` always; ``tensorboard: true`` (``ddpx[tensorboard]``):
  ``<run_dir>/tensorboard``; ``wandb.project`` set (``ddpx[wandb]``): a Weights
  & Biases run; ``mlflow.experiment`` set (``ddpx[mlflow]``): an MLflow run.
  Scalar names there: ``train/<key>`` for step lines (``comm/<key>`` for the
  comm hook's), ``epoch/<metric>`` for epoch lines; the x axis is the
  optimizer step. W&B and MLflow runs are resumed (the run id is kept in the
  run directory), and get ``metrics.jsonl`` and the final checkpoint as files.
* Nothing runs per step: on rank 0, when there is a bar or step lines, the
  plugin is called (``trainer.call_at_step``) at logged steps and, for the
  bar, about every ``BAR_SECONDS`` (the number of steps adapts to the step
  time); the bar also advances at the epoch end.

Config section ``logging``: ``progress`` (true), ``all_ranks`` (false),
``every_steps`` (50, as Lightning's ``log_every_n_steps``; 0 writes only
per-epoch lines), ``metrics_file`` (``metrics.jsonl``; relative to the run
directory), ``tensorboard`` (false), ``wandb`` (``project``, ``entity``,
``name``, ``tags``, ``mode``), ``mlflow`` (``tracking_uri``, ``experiment``,
``run_name``).

Per-run state: ``trainer.plugin("logging").state`` (a :class:`MetricsLog`; docs/plugins.md, "Per-run state").
"""

import importlib.util
import json
import logging
import math
import os
import pathlib
import sys
import time
import uuid

from ddpx import hookimpl
from ddpx.errors import DdpxError
from ddpx.plugin.manager import rank_prefix
from ddpx.plugin.shared import COMM_HOOK, EMA_WEIGHTS_FILE, LAST_FINITE_CHECKPOINT

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


# --- backends: where rank 0's records go ---------------------------------------------------


def scalar_names(kind, values):
    """The numbers of a record under the names the scalar backends share:
    ``train/<key>`` (``comm/<key>`` for ``comm_<key>``) on step lines, ``epoch/<key>`` on epoch lines."""
    out = {}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or key in ("step", "epoch", "time"):
            continue
        if kind == "epoch":
            out[f"epoch/{key}"] = value
        elif key.startswith("comm_"):
            out[f"comm/{key[len('comm_'):]}"] = value
        else:
            out[f"train/{key}"] = value
    return out


class Backend:
    """One place rank 0's metrics go. ``log_metrics`` gets every record: ``kind`` is
    ``"step"`` (a step line) or ``"epoch"``, ``step`` the optimizer step, ``values``
    the record (numbers, and for epochs whatever the metrics hold)."""

    def log_config(self, config: dict) -> None:
        """The resolved config, once, at the start."""

    def log_metrics(self, kind: str, step: int, values: dict) -> None:
        raise NotImplementedError

    def log_file(self, path: str) -> None:
        """A file of the run (``metrics.jsonl``, the final checkpoint), at the end."""

    def close(self, failed: bool = False) -> None:
        """The run ended (``failed``: by an exception)."""


class JsonlBackend(Backend):
    """``metrics.jsonl``: one JSON object per record, appended (a resumed run continues it)."""

    def __init__(self, path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self.file = open(path, "a")
        self.flushed = 0.0  # perf_counter of the last flush

    def log_metrics(self, kind, step, values):
        self.file.write(json.dumps({"kind": kind, "step": step, **values}, default=_plain) + "\n")
        now = time.perf_counter()
        if kind == "epoch" or now - self.flushed >= FLUSH_EVERY_S:  # step lines: a flush at most once a second
            self.file.flush()
            self.flushed = now

    def close(self, failed=False):
        self.file.close()


class TensorBoardBackend(Backend):
    """``<run_dir>/tensorboard`` through ``torch.utils.tensorboard`` (``logging.tensorboard``)."""

    def __init__(self, run_dir):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(run_dir, "tensorboard"))

    def log_config(self, config):
        import yaml

        self.writer.add_text("config", "```\n" + yaml.safe_dump(config, sort_keys=False) + "```", 0)

    def log_metrics(self, kind, step, values):
        for name, value in scalar_names(kind, values).items():
            self.writer.add_scalar(name, value, step)
        if kind == "epoch":
            self.writer.flush()

    def close(self, failed=False):
        self.writer.close()


class WandbBackend(Backend):
    """A Weights & Biases run (``logging.wandb``). Its id is kept in ``<run_dir>/wandb_run_id``:
    a resumed run (same run directory) continues the same W&B run."""

    ID_FILE = "wandb_run_id"

    def __init__(self, run_dir, cfg, config):
        import wandb

        id_path = os.path.join(run_dir, self.ID_FILE)
        run_id = _read_id(id_path) or uuid.uuid4().hex[:8]  # W&B's own ids: 8 lowercase letters and digits
        _write_id(id_path, run_id)
        self.run = wandb.init(project=cfg["project"], entity=cfg["entity"], name=cfg["name"],
                              tags=list(cfg["tags"]) or None, mode=cfg["mode"], dir=run_dir, id=run_id,
                              resume="allow", config=config, reinit="create_new")

    def log_metrics(self, kind, step, values):
        self.run.log(scalar_names(kind, values), step=step)

    def log_file(self, path):
        self.run.save(path, base_path=os.path.dirname(path), policy="now")

    def close(self, failed=False):
        self.run.finish(exit_code=1 if failed else 0)


class MlflowBackend(Backend):
    """An MLflow run (``logging.mlflow``) through ``MlflowClient``: the config as params,
    metrics per step, files as artifacts. The tracking URI defaults to a local store in
    ``<run_dir>/mlruns``; the run id is kept in ``<run_dir>/mlflow_run_id``, so a resumed
    run continues the same MLflow run."""

    ID_FILE = "mlflow_run_id"
    BATCH = 100  # params per log_batch call (MLflow's limit)

    def __init__(self, run_dir, cfg, log):
        from mlflow.tracking import MlflowClient

        uri = cfg["tracking_uri"] or local_mlflow_uri(run_dir)
        # The local store keeps its artifacts beside it (MLflow's default is ./mlruns in the current directory).
        artifacts = None if cfg["tracking_uri"] else pathlib.Path(run_dir, "mlruns", "artifacts").absolute().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        self.log = log
        experiment = self.client.get_experiment_by_name(cfg["experiment"])
        experiment_id = experiment.experiment_id if experiment else \
            self.client.create_experiment(cfg["experiment"], artifact_location=artifacts)
        id_path = os.path.join(run_dir, self.ID_FILE)
        self.run_id = _read_id(id_path)
        if self.run_id is not None:
            try:
                self.client.update_run(self.run_id, status="RUNNING")
            except Exception as exc:  # e.g. another tracking URI now
                log.warning(f"logging.mlflow: cannot continue run {self.run_id} of {id_path} ({exc}); starting a new run")
                self.run_id = None
        if self.run_id is None:
            name = cfg["run_name"] or os.path.basename(os.path.normpath(run_dir))
            self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
            _write_id(id_path, self.run_id)

    def log_config(self, config):
        from mlflow.entities import Param

        logged = self.client.get_run(self.run_id).data.params  # a resumed run has them already
        params = [Param(k, v) for k, v in _flat(config).items() if k not in logged]
        changed = [k for k, v in _flat(config).items() if k in logged and logged[k] != v]
        if changed:
            self.log.warning(f"logging.mlflow: the resumed run keeps its first values of {', '.join(changed)} "
                             "(MLflow params cannot change)")
        for i in range(0, len(params), self.BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + self.BATCH])

    def log_metrics(self, kind, step, values):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(name, float(value), now, step) for name, value in scalar_names(kind, values).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def log_file(self, path):
        self.client.log_artifact(self.run_id, path)

    def close(self, failed=False):
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def local_mlflow_uri(run_dir):
    """The default MLflow store: a SQLite database (its artifacts beside it) in ``<run_dir>/mlruns``."""
    directory = os.path.join(run_dir, "mlruns")
    os.makedirs(directory, exist_ok=True)
    return "sqlite:///" + os.path.abspath(os.path.join(directory, "mlflow.db"))


def _read_id(path):
    try:
        with open(path) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def _write_id(path, run_id):
    with open(path, "w") as f:
        f.write(run_id + "\n")


def _flat(config, prefix=""):
    """``{"trainer.batch_size": "32", ...}``: the config as MLflow params (strings)."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)[:MAX_PARAM_CHARS]
    return out


MAX_PARAM_CHARS = 6000  # MLflow's limit on a param's value


# --- the run's state ------------------------------------------------------------------------


class MetricsLog:
    """What one run of the logging plugin holds. Rank 0 shows the bar and feeds the
    backends; other ranks do nothing per step."""

    def __init__(self, every_steps, progress, samples_per_batch):
        self.every_steps = every_steps
        self.progress = progress
        self.samples_per_batch = samples_per_batch
        self.backends: list = []  # rank 0's Backend objects, metrics.jsonl first
        self.comm_counted = (0, 0)  # (wire bytes, steps) of the comm hook at the last step line
        self.bar = None
        self.window = None  # the trainer's LossWindow since the last step line (rank 0)
        self.bar_window = None  # and the one since the bar's last redraw
        self.postfix = {}  # the bar's loss and samples/s
        self.bar_shown = 0  # micro-batches of the window already shown on the bar
        self.epoch_base = 0  # micro-batches of the window from before this epoch: not in the throughput
        self.bar_steps = 1  # optimizer steps between bar updates, adapted to the step time
        self.last_call = (0, 0.0)  # (global_step, perf_counter) of the last scheduled call
        self.mark = time.perf_counter()  # start of the throughput's time span
        self.start = self.mark

    def log_metrics(self, kind, step, values):
        for backend in self.backends:
            backend.log_metrics(kind, step, values)

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
            "epoch": trainer.epoch,
            "loss": mean_loss,
            "lr": trainer.optimizer.param_groups[0]["lr"],
            "samples_per_s": samples_per_s,
            "time": now - self.start,
        }
        if trainer.grad_norm_step == trainer.global_step:
            record["grad_norm"] = trainer.grad_norm.item()
        record.update(self.training_state(trainer))
        self.log_metrics("step", trainer.global_step, record)
        if self.bar is not None:
            self.postfix["samples_s"] = f"{samples_per_s:.0f}"
            self.bar.set_postfix(self.postfix, refresh=False)

    def training_state(self, trainer):
        """The AMP scale and the comm hook's traffic since the last step line."""
        state = {}
        if trainer.scaler.is_enabled():
            state["amp_scale"] = trainer.scaler.get_scale()
        hook = trainer.shared.get(COMM_HOOK)
        stats = hook.stats() if hook is not None else None
        if stats is not None:
            wire, steps = self.comm_counted
            if stats["steps"] > steps:
                state["comm_wire_bytes_per_step"] = (stats["wire_bytes"] - wire) / (stats["steps"] - steps)
            if stats["compression"] is not None:
                state["comm_compression"] = stats["compression"]
            self.comm_counted = (stats["wire_bytes"], stats["steps"])
        return state

    def close(self, trainer=None, failed=False):
        """Close the bar and every backend; ``trainer`` (a normal end): hand them the
        run's files first (``metrics.jsonl``, the final checkpoint, the EMA weights)."""
        if self.bar is not None:
            self.advance_bar()
            self.bar.close()
            self.bar = None
        backends, self.backends = self.backends, []
        if backends:
            backends[0].file.flush()  # metrics.jsonl, complete before it is copied
        files = _run_files(trainer, backends[0].path) if trainer is not None and backends else []
        for backend in backends:
            try:
                for path in files:
                    backend.log_file(path)
            finally:
                backend.close(failed=failed)


def _run_files(trainer, metrics_path):
    files = [metrics_path, trainer.shared.get(LAST_FINITE_CHECKPOINT), trainer.shared.get(EMA_WEIGHTS_FILE)]
    return [path for path in files if path and os.path.isfile(path)]


def _plain(value):
    """JSON for tensors and numpy scalars in metrics."""
    if hasattr(value, "item"):
        return value.item()
    return str(value)


# --- hooks -----------------------------------------------------------------------------------

EXTRAS = {  # config key -> (import name, extra)
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}


def wanted_backends(cfg):
    """The optional backends a ``logging`` section turns on."""
    return [name for name, on in (("tensorboard", cfg["tensorboard"]), ("wandb", cfg["wandb"]["project"]),
                                  ("mlflow", cfg["mlflow"]["experiment"])) if on]


def _importable(module):
    try:
        if module == "torch.utils.tensorboard":
            import torch.utils.tensorboard  # noqa: F401  (itself checks for the tensorboard package)

            return True
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def open_backends(trainer, cfg):
    """Rank 0's backends: ``metrics.jsonl``, then the optional ones the config names."""
    run_dir = str(trainer.run_dir)
    backends = [JsonlBackend(os.path.join(run_dir, cfg["metrics_file"]))]
    wanted = wanted_backends(cfg)
    config = trainer.config.to_dict()
    try:
        if "tensorboard" in wanted:
            backends.append(TensorBoardBackend(run_dir))
        if "wandb" in wanted:
            backends.append(WandbBackend(run_dir, cfg["wandb"], config))
        if "mlflow" in wanted:
            backends.append(MlflowBackend(run_dir, cfg["mlflow"], trainer.log))
        for backend in backends:
            backend.log_config(config)
    except BaseException:
        for backend in backends:
            backend.close(failed=True)
        raise
    return backends


def _format(value):
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.4g}"
    return str(value)


class LoggingPlugin:
    """``state``: the run's :class:`MetricsLog` (None before ``ddpx_setup``)."""

    def __init__(self):
        self.state = None

    @hookimpl
    def ddpx_config_defaults(self):
        return {"logging": {"progress": True, "all_ranks": False, "every_steps": 50, "metrics_file": "metrics.jsonl",
                            "tensorboard": False,
                            "wandb": {"project": None, "entity": None, "name": None, "tags": [], "mode": None},
                            "mlflow": {"tracking_uri": None, "experiment": None, "run_name": None}}}

    @hookimpl
    def ddpx_configure(self, config):
        cfg = config.section("logging")
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
        for name in wanted_backends(cfg):
            module, extra = EXTRAS[name]
            if not _importable("torch.utils.tensorboard" if name == "tensorboard" else module):
                turn_off = {"tensorboard": "tensorboard=false", "wandb": "wandb.project=null",
                            "mlflow": "mlflow.experiment=null"}[name]
                raise DdpxError(f"logging.{name} needs the {module} package: pip install 'ddpx[{extra}]' "
                                f"(or set logging.{turn_off})")

    @hookimpl(tryfirst=True)  # before other plugins log from their setup hooks
    def ddpx_setup(self, trainer):
        cfg = trainer.config.section("logging")
        configure_logger(trainer.rank, cfg["all_ranks"])
        samples_per_batch = trainer.world_size * trainer.config.trainer.batch_size
        self.state = MetricsLog(cfg["every_steps"], cfg["progress"], samples_per_batch)

    @hookimpl
    def ddpx_train_start(self, trainer):
        log = self.state
        log.start = log.mark = time.perf_counter()
        if trainer.rank != 0:
            return
        log.backends = open_backends(trainer, trainer.config.section("logging"))
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
            epochs_left = trainer.config.trainer.epochs - epoch
            has_len = hasattr(trainer.train_loader, "__len__")
            log.start_bar(epoch, len(trainer.train_loader) * epochs_left if has_len else None)

    @hookimpl(trylast=True)  # after other plugins added their entries to ``metrics``
    def ddpx_epoch_end(self, trainer, epoch, metrics):
        log = self.state
        if trainer.rank != 0:
            return
        log.advance_bar()
        log.log_metrics("epoch", trainer.global_step, {"epoch": epoch, **{k: v for k, v in metrics.items()
                                                                            if k != "step"}})
        shown = "  ".join(f"{k} {_format(v)}" for k, v in metrics.items() if k not in ("epoch", "step"))
        trainer.log.info("epoch %d (step %d): %s", epoch, trainer.global_step, shown)

    @hookimpl(wrapper=True)  # around every other plugin's: the final checkpoint is written when it closes
    def ddpx_train_end(self, trainer):
        result = yield
        self.state.close(trainer)
        return result

    @hookimpl
    def ddpx_exception(self, trainer, exc):
        log, self.state = self.state, None
        if log is not None:  # None: ddpx_setup did not run
            log.close(failed=True)

"""The tracker backends, where rank 0's records go: ``metrics.jsonl``, TensorBoard,
Weights & Biases and MLflow, each behind the small :class:`Backend` interface. The
optional packages (tensorboard, wandb, mlflow) are imported only when their backend opens."""

import json
import os
import pathlib
import time
import uuid

FLUSH_EVERY_S = 1.0  # step lines: a flush (a system call) at most this often


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
        """A file of the run (``metrics.jsonl``, the final checkpoint) or a directory of files
        (``model/``, kept as one folder under its name), at the end."""

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


def _plain(value):
    """JSON for tensors and numpy scalars in metrics."""
    if hasattr(value, "item"):
        return value.item()
    return str(value)


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
        base = os.path.dirname(os.path.normpath(path))  # a directory's files keep its name in front
        self.run.save(os.path.join(path, "*") if os.path.isdir(path) else path, base_path=base, policy="now")

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
        if os.path.isdir(path):
            self.client.log_artifacts(self.run_id, path, artifact_path=os.path.basename(os.path.normpath(path)))
        else:
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


def wanted_backends(cfg):
    """The optional backends a ``logging`` section turns on."""
    return [name for name, on in (("tensorboard", cfg["tensorboard"]), ("wandb", cfg["wandb"]["project"]),
                                  ("mlflow", cfg["mlflow"]["experiment"])) if on]


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

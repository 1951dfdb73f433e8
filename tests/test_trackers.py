"""Experiment trackers with the real packages: Weights & Biases in offline mode, MLflow
against a real tracking server (SQLite backend, local artifact root) and the local default
store. Each gets the same records as metrics.jsonl; a resumed run continues the same
tracker run."""

import json
import os
import sys
import urllib.request

import pytest

import harness
from ddpx.config import load_config
from ddpx.errors import DdpxError
from ddpx.train.trainer import Trainer

RUN = ["trainer.epochs=1", "logging.every_steps=5", "trainer.eval_every_epochs=1"]


def records(run_dir, kind):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.mark.parametrize("key, extra", [("logging.wandb.project=p", "wandb"),
                                        ("logging.mlflow.experiment=e", "mlflow")])
def test_a_missing_tracker_package_is_one_line_naming_the_extra(monkeypatch, key, extra):
    monkeypatch.setitem(sys.modules, extra, None)  # import fails as if not installed
    with pytest.raises(DdpxError, match=rf"logging.{extra} needs the {extra} package: pip install 'ddpx\[{extra}\]'"):
        load_config(None, [key])


def test_a_bad_wandb_mode_is_one_line():
    with pytest.raises(DdpxError, match="logging.wandb.mode must be online, offline, disabled or null"):
        load_config(None, ["logging.wandb.project=p", "logging.wandb.mode=sometimes"])


# --- checked at launch, before any worker starts (issue 40, item 6) ---------------------------------


def launch_refused(tmp_path, monkeypatch, capsys, *overrides):
    """``ddpx train`` with ``overrides``: (exit code, stderr lines, whether the run started)."""
    from ddpx.cli import main

    started = []
    monkeypatch.setattr("ddpx.launch.launcher.run_torchrun", lambda argv: started.append(argv) or 0)
    code = main(["train", f"run_dir={tmp_path / 'run'}", *overrides])
    return code, capsys.readouterr().err.splitlines(), bool(started) or (tmp_path / "run").exists()


@pytest.mark.parametrize("override, tracker, key, switch", [
    ("logging.mlflow.tracking_uri=http://mlflow.example:5000", "mlflow", "tracking_uri", "experiment"),
    ("logging.mlflow.run_name=first", "mlflow", "run_name", "experiment"),
    ("logging.wandb.entity=me", "wandb", "entity", "project"),
    ("logging.wandb.mode=offline", "wandb", "mode", "project"),
    ("logging.wandb.tags=[baseline]", "wandb", "tags", "project"),
])
def test_tracker_settings_without_the_key_that_turns_it_on_stop_the_launch(tmp_path, monkeypatch, capsys, override,
                                                                           tracker, key, switch):
    """``logging.mlflow.tracking_uri`` without ``logging.mlflow.experiment`` was silently off."""
    code, err, started = launch_refused(tmp_path, monkeypatch, capsys, override)
    assert (code, started) == (2, False)
    assert err == [f"ddpx: error: logging.{tracker}.{key} is set but logging.{tracker}.{switch} is not, so nothing "
                   f"goes to {tracker}: set logging.{tracker}.{switch}=NAME (or remove logging.{tracker}.{key})"]


MLFLOW_FILE_STORE_REFUSAL = (  # what MLflow 3.18's MlflowClient raises for a file store (./mlruns, file:///...)
    "The filesystem tracking backend (e.g., './mlruns') is in maintenance mode and will not receive further "
    "updates. Please migrate to a database backend (e.g., 'sqlite:///mlflow.db') to access the latest MLflow "
    "features. The `mlflow migrate-filestore` tool migrates your existing data losslessly. See "
    "https://mlflow.org/docs/latest/self-hosting/migrate-from-file-store for migration guidance. If the "
    "filesystem backend is required for your workflow, set `MLFLOW_ALLOW_FILE_STORE=true` to opt out of this "
    "exception.")


def fake_mlflow(monkeypatch, refusal):
    """An installed ``mlflow`` 3.18 whose ``MlflowClient(tracking_uri=...)`` raises ``refusal`` for file
    stores (as the real one does when it builds the store) and accepts the rest; returns the URIs asked."""
    import importlib.machinery
    import types

    asked = []

    class MlflowClient:
        def __init__(self, tracking_uri=None):
            asked.append(tracking_uri)
            if "://" not in tracking_uri or tracking_uri.startswith("file:"):
                raise RuntimeError(refusal)

    mlflow, tracking = types.ModuleType("mlflow"), types.ModuleType("mlflow.tracking")
    mlflow.__spec__ = importlib.machinery.ModuleSpec("mlflow", None)
    mlflow.__version__, mlflow.tracking, tracking.MlflowClient = "3.18.0", tracking, MlflowClient
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    monkeypatch.setitem(sys.modules, "mlflow.tracking", tracking)
    return asked


def test_a_tracking_uri_the_installed_mlflow_refuses_stops_the_launch_in_one_line(tmp_path, monkeypatch, capsys):
    """It killed both workers after start with 166 lines."""
    asked = fake_mlflow(monkeypatch, MLFLOW_FILE_STORE_REFUSAL)
    code, err, started = launch_refused(tmp_path, monkeypatch, capsys, "logging.mlflow.experiment=digits",
                                        "logging.mlflow.tracking_uri=./mlruns")
    assert (code, started, asked) == (2, False, ["./mlruns"])
    assert err == ["ddpx: error: logging.mlflow.tracking_uri=./mlruns: MLflow 3.18.0 refuses it (The filesystem "
                   "tracking backend (e.g., './mlruns') is in maintenance mode and will not receive further "
                   "updates); use a database (sqlite:///PATH/mlflow.db) or an http(s) server, or set "
                   "MLFLOW_ALLOW_FILE_STORE=true to keep the file store, or set logging.mlflow.tracking_uri=null "
                   "for a SQLite store in the run directory"]
    code, err, started = launch_refused(tmp_path, monkeypatch, capsys, "logging.mlflow.experiment=digits",
                                        "logging.mlflow.tracking_uri=http://mlflow.example:5000")
    assert (code, err, started) == (0, [], True)  # an accepted URI: the run starts (no request is made)
    code, err, started = launch_refused(tmp_path, monkeypatch, capsys, "logging.mlflow.experiment=digits")
    assert (code, started, asked[-1]) == (0, True, "http://mlflow.example:5000")  # the default store: not asked
    import ddpx_plugins.logging as logging_plugin

    monkeypatch.setattr(logging_plugin, "_importable", lambda module: module != "alembic")  # mlflow-skinny
    code, err, started = launch_refused(tmp_path / "skinny", monkeypatch, capsys, "logging.mlflow.experiment=digits")
    assert (code, started) == (2, False)
    assert err == ["ddpx: error: logging.mlflow.tracking_uri=null keeps MLflow's runs in a SQLite store in the run "
                   "directory, which needs alembic (not installed: mlflow-skinny lacks them); pip install "
                   "'ddpx[mlflow]' (the full mlflow), or set logging.mlflow.tracking_uri to an http(s) server"]
    monkeypatch.setattr(logging_plugin, "_importable", lambda module: True)
    monkeypatch.setenv("RANK", "1")  # a worker: the launcher checked; a check on some ranks only would hang the rest
    load_config(None, ["logging.mlflow.experiment=digits", "logging.mlflow.tracking_uri=./mlruns"])
    assert asked == ["./mlruns", "http://mlflow.example:5000"]


def test_trackers_get_the_trained_model_directory_under_its_name(tmp_path):
    """``run_dir/model/`` (model.safetensors, a HF model's config.json) goes to W&B and MLflow
    beside metrics.jsonl and the final checkpoint, as one folder ``model``."""
    from types import SimpleNamespace

    from ddpx.plugin.shared import LAST_FINITE_CHECKPOINT
    from ddpx_plugins.logging.metrics_log import _run_files
    from ddpx_plugins.logging.trackers import MlflowBackend, WandbBackend

    (tmp_path / "model").mkdir()
    for name in ("metrics.jsonl", "model/model.safetensors", "model/config.json"):
        (tmp_path / name).write_text("x")
    trainer = SimpleNamespace(run_dir=tmp_path, shared={LAST_FINITE_CHECKPOINT: str(tmp_path / "gone.pt")})
    files = _run_files(trainer, str(tmp_path / "metrics.jsonl"))
    assert files == [str(tmp_path / "metrics.jsonl"), str(tmp_path / "model")]  # no checkpoint file: not listed

    saved, logged = [], []
    wandb = WandbBackend.__new__(WandbBackend)
    wandb.run = SimpleNamespace(save=lambda glob, base_path, policy: saved.append((glob, base_path, policy)))
    mlflow = MlflowBackend.__new__(MlflowBackend)
    mlflow.run_id = "r1"
    mlflow.client = SimpleNamespace(log_artifact=lambda run, path: logged.append((run, path, None)),
                                    log_artifacts=lambda run, path, artifact_path: logged.append((run, path,
                                                                                                  artifact_path)))
    for path in files:
        wandb.log_file(path)
        mlflow.log_file(path)
    assert saved == [(str(tmp_path / "metrics.jsonl"), str(tmp_path), "now"),
                     (str(tmp_path / "model" / "*"), str(tmp_path), "now")]  # saved as model/model.safetensors
    assert logged == [("r1", str(tmp_path / "metrics.jsonl"), None), ("r1", str(tmp_path / "model"), "model")]


# --- Weights & Biases, offline ----------------------------------------------------------------


def wandb_records(path):
    """The protobuf records of an offline run file (``run-<id>.wandb``): W&B's log format, a
    7-byte header, then 32 KiB blocks of records, each with a 7-byte header (crc32, length,
    type: 1 full, 2 first, 3 middle, 4 last piece)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield wandb_internal_pb2.Record.FromString(pending)
            pending = b""


def wandb_offline_runs(run_dir):
    """``[(run id, history rows, config)]`` of each offline run directory, oldest first."""
    runs = []
    for directory in sorted((run_dir / "wandb").glob("offline-run-*")):
        (path,) = directory.glob("run-*.wandb")
        history, config, run_id = [], {}, None
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
                config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
            elif kind == "config":
                config.update({item.key: json.loads(item.value_json) for item in record.config.update})
            elif kind == "history":
                history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                for item in record.history.item})
        runs.append((run_id, history, config))
    return runs


def unwrap(config_value):
    return config_value["value"] if isinstance(config_value, dict) and "value" in config_value else config_value


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_wandb_offline_holds_the_metrics_and_config_and_a_resume_continues_the_run(make_config, tmp_path,
                                                                                  monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    tracked = [*RUN, "logging.wandb.project=ddpx-test", "logging.wandb.mode=offline", "logging.wandb.tags=[a, b]"]
    Trainer(make_config(*tracked, "trainer.max_steps=10")).run()
    Trainer(make_config(*tracked, "trainer.max_steps=20")).run()  # resumes from step 10

    run_id = (run_dir / "wandb_run_id").read_text().strip()
    runs = wandb_offline_runs(run_dir)
    assert [r[0] for r in runs] == [run_id, run_id]  # the resumed run appends to the same W&B run
    history = [row for _, rows, _ in runs for row in rows]
    steps = records(run_dir, "step")
    assert [r["step"] for r in steps] == [5, 10, 15, 20]
    logged = {row["_step"]: row for row in history}
    for r in steps:
        for key in ("loss", "lr", "samples_per_s", "grad_norm"):
            assert logged[r["step"]][f"train/{key}"] == pytest.approx(r[key], rel=1e-6)
    for r in records(run_dir, "epoch"):
        for key in ("loss", "eval_loss", "accuracy"):
            assert logged[r["step"]][f"epoch/{key}"] == pytest.approx(r[key], rel=1e-6)
    config = runs[0][2]
    assert unwrap(config["trainer"])["batch_size"] == 32
    assert unwrap(config["logging"])["wandb"]["project"] == "ddpx-test"


# --- MLflow ------------------------------------------------------------------------------------


def check_mlflow_run(client, run_dir, experiment):
    from ddpx.rank.checkpoint_files import CheckpointDirectory

    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    run = client.get_run(run_id)
    assert client.get_experiment(run.info.experiment_id).name == experiment
    assert run.info.status == "FINISHED"
    assert run.data.params["trainer.batch_size"] == "32" and run.data.params["optimizer.args.lr"] == "0.1"
    steps = records(run_dir, "step")
    for key in ("loss", "lr", "grad_norm", "samples_per_s"):
        history = client.get_metric_history(run_id, f"train/{key}")
        assert sorted((m.step, m.value) for m in history) == [(r["step"], pytest.approx(r[key], rel=1e-6))
                                                             for r in steps]
    epochs = records(run_dir, "epoch")
    history = client.get_metric_history(run_id, "epoch/accuracy")
    assert sorted((m.step, m.value) for m in history) == [(r["step"], pytest.approx(r["accuracy"])) for r in epochs]
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    final = CheckpointDirectory(run_dir / "checkpoints", keep=3).checkpoints()[-1][1]
    assert {"metrics.jsonl", final.name, "model"} <= artifacts
    assert {a.path for a in client.list_artifacts(run_id, "model")} == {"model/model.safetensors"}
    return run_id


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_mlflow_default_local_store_and_resume(make_config, tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from ddpx_plugins.logging.trackers import local_mlflow_uri

    run_dir = tmp_path / "run"
    tracked = [*RUN, "logging.mlflow.experiment=digits"]
    Trainer(make_config(*tracked, "trainer.max_steps=10")).run()
    first = (run_dir / "mlflow_run_id").read_text().strip()
    Trainer(make_config(*tracked, "trainer.max_steps=20")).run()
    client = MlflowClient(tracking_uri=local_mlflow_uri(str(run_dir)))
    assert (run_dir / "mlruns" / "mlflow.db").exists()
    assert check_mlflow_run(client, run_dir, "digits") == first  # the resume continued the same run
    assert [r["step"] for r in records(run_dir, "step")] == [5, 10, 15, 20]


@pytest.fixture
def mlflow_server(tmp_path):
    """A real ``mlflow server`` on a free loopback port: SQLite backend, local artifact root."""
    pytest.importorskip("mlflow")
    port = harness.free_port()
    root = tmp_path / "server"
    root.mkdir()
    log = root / "server.log"
    proc = harness.start([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", port,
                          "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
                          "--default-artifact-root", (root / "artifacts").as_uri(), "--workers", "1"],
                         log, harness.base_env(), cwd=root)
    url = f"http://127.0.0.1:{port}"

    def healthy():
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    try:
        if not harness.wait_for(lambda: proc.poll() is not None or healthy(), 90, poll=0.5) or not healthy():
            raise AssertionError(f"mlflow server did not start:\n{log.read_text()[-3000:]}")
        yield url
    finally:
        os.killpg(proc.pid, 15)
        if not harness.wait_for(lambda: proc.poll() is not None, 20):
            os.killpg(proc.pid, 9)
            proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mlflow_tracking_server_gets_params_metrics_artifacts_and_the_resume(make_config, tmp_path,
                                                                           mlflow_server):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    tracked = [*RUN, f"logging.mlflow.tracking_uri={mlflow_server}", "logging.mlflow.experiment=digits-server",
               "logging.mlflow.run_name=first"]
    Trainer(make_config(*tracked, "trainer.max_steps=10")).run()
    first = (run_dir / "mlflow_run_id").read_text().strip()
    Trainer(make_config(*tracked, "trainer.max_steps=20")).run()
    client = MlflowClient(tracking_uri=mlflow_server)
    assert check_mlflow_run(client, run_dir, "digits-server") == first
    assert client.get_run(first).info.run_name == "first"
    experiment = client.get_experiment_by_name("digits-server")
    assert len(client.search_runs([experiment.experiment_id])) == 1  # no second run for the resume

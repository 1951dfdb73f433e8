"""What a user meets when something is wrong (issue 40, items 1, 2, 4, 5 and Ctrl-C): an error
raised in the workers is one line on the terminal, checked before any worker starts where it
can be; a resume hint only when there is a checkpoint; no empty run directory left behind."""

import glob
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

import harness
from ddpx.config import load_config
from ddpx.errors import DdpxError


def check_target_arguments(config):
    from ddpx.launch.preflight import check_target_arguments

    check_target_arguments(config)

MODELS = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 2))

    def forward(self, x):
        return self.f(x)


class Broken(Net):
    def forward(self, x):
        return self.f(x[:, :4])  # a bug: the wrong shape


class AnyArgs(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.f = nn.Linear(8, 2)

    def forward(self, x):
        return self.f(x)


def make_data(n=256):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long()
    data = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.Subset(data, range(192)), torch.utils.data.Subset(data, range(192, n))
'''

CONFIG = '''
model: {target: mymodels.Net, args: {hidden: 16}}
data: {target: mymodels.make_data, args: {n: 256}}
optimizer: {target: torch.optim.SGD, args: {lr: 0.1}}
trainer: {epochs: 3, batch_size: 16}
launch: {nproc_per_node: 2}
logging: {progress: false}
'''

# A plugin in the project directory that fails at the start of epoch 1 (the smoke run must get there).
EPOCH1_PLUGIN = '''
from ddpx import hookimpl


@hookimpl
def ddpx_epoch_start(trainer, epoch):
    if epoch == 1:
        raise RuntimeError("metrics.csv is missing; create it")
'''


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user's project directory: their model module, a plugin, a YAML; the current directory."""
    (tmp_path / "mymodels.py").write_text(textwrap.dedent(MODELS))
    (tmp_path / "epoch1plug.py").write_text(textwrap.dedent(EPOCH1_PLUGIN))
    (tmp_path / "cfg.yaml").write_text(textwrap.dedent(CONFIG))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def one_line_error(fn, *args) -> str:
    with pytest.raises(DdpxError) as info:
        fn(*args)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# --- checked before any worker starts ------------------------------------------------------


@pytest.mark.parametrize("override, expected", [
    ("optimizer.args.lrr=0.1", "optimizer.args.lrr: torch.optim.SGD has no argument 'lrr'; "
                               "did you mean 'optimizer.args.lr'?"),
    ("model.args.hiden=8", "model.args.hiden: mymodels.Net has no argument 'hiden'; did you mean 'model.args.hidden'?"),
    ("data.args.m=3", "data.args.m: mymodels.make_data has no argument 'm'; it takes n"),
    ("scheduler.target=torch.optim.lr_scheduler.StepLR",
     "scheduler: torch.optim.lr_scheduler.StepLR needs the argument step_size; set scheduler.args.step_size=VALUE"),
    ("optimizer.args.params=[]", "optimizer.args.params: the trainer passes 'params' to torch.optim.SGD itself"),
])
def test_target_arguments_are_checked_against_their_signatures(project, override, expected):
    message = one_line_error(check_target_arguments, load_config("cfg.yaml", [override]))
    assert message.startswith(expected), message


def test_targets_taking_kwargs_accept_any_argument(project):
    check_target_arguments(load_config("cfg.yaml", ["model.target=mymodels.AnyArgs", "model.args={anything: 1}"]))
    check_target_arguments(load_config("cfg.yaml", ["scheduler.target=torch.optim.lr_scheduler.StepLR",
                                                    "scheduler.args.step_size=3", "optimizer.args.momentum=0.9"]))
    check_target_arguments(load_config(None, []))  # the built-in example


def test_a_target_refusing_its_arguments_is_a_config_error_naming_them():
    from ddpx.imports import instantiate

    params = [torch.zeros(2, requires_grad=True)]
    message = one_line_error(instantiate, {"target": "torch.optim.SGD", "args": {"lr": -0.1}}, "optimizer", params)
    assert message == ("optimizer: torch.optim.SGD(lr=-0.1) failed: ValueError: Invalid learning rate: -0.1; "
                       "fix optimizer.args")


def test_a_missing_module_says_where_it_was_looked_for(project, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.chdir(elsewhere)
    message = one_line_error(load_config, str(project / "cfg.yaml"), ["model.target=mymodelz.Net"])
    assert message.startswith(f"model.target 'mymodelz.Net' does not resolve: no module named 'mymodelz' in "
                              f"{project} (the config file's directory), {elsewhere} (the current directory), "
                              "PYTHONPATH and the installed packages"), message


def test_a_section_of_a_blocked_plugin_names_the_plugin(project):
    message = one_line_error(load_config, "cfg.yaml", ["plugins.block=[amp]", "amp.enabled=false"])
    assert message == ("config section 'amp' belongs to the plugin 'amp', which plugins.block blocks; "
                       "remove the section, or take 'amp' out of plugins.block")
    # A plugin whose section has another name (the profiler's is 'profile').
    message = one_line_error(load_config, "cfg.yaml", ["plugins.block=[profiler]", "profile.enabled=false"])
    assert "belongs to the plugin 'profiler'" in message
    message = one_line_error(load_config, "cfg.yaml", ["plugins.block=[amp]", "ampp.x=1"])
    assert message.startswith("unknown key 'ampp' in the config"), message  # not the blocked plugin's


# --- what a failing rank prints --------------------------------------------------------------


def test_one_rank_per_node_prints_a_failure(monkeypatch):
    from ddpx.rank.failures import claim_report

    store = torch.distributed.HashStore()
    said = []
    for node, rank in (("0", "1"), ("0", "0"), ("1", "2"), ("1", "3")):
        monkeypatch.setenv("GROUP_RANK", node)
        monkeypatch.setenv("RANK", rank)
        said.append(claim_report(store))
    assert said == [True, False, True, False]
    assert claim_report(None)  # no store to ask: print


def test_the_failure_line_names_the_plugin_and_where_it_raised():
    from ddpx.errors import TrainingDiverged
    from ddpx.plugin.manager import ORIGIN_ATTRIBUTE
    from ddpx.rank.failures import failure_line

    def raise_(exc):
        try:
            raise exc
        except Exception as caught:
            return caught

    exc = raise_(RuntimeError("metrics.csv is missing"))
    setattr(exc, ORIGIN_ATTRIBUTE, ("epoch1plug", "ddpx_epoch_start"))
    line, traceback_too = failure_line(exc)
    assert line == (f"plugin 'epoch1plug' raised in ddpx_epoch_start: RuntimeError: metrics.csv is missing "
                    f"(test_user_errors.py:{exc.__traceback__.tb_lineno})") and not traceback_too
    assert failure_line(raise_(RuntimeError("bug")))[1]  # not from a plugin: the traceback comes too
    assert failure_line(exc, "stopped at step 3: rank 1 failed first: ...") == \
        ("stopped at step 3: rank 1 failed first: ...", False)
    assert failure_line(TrainingDiverged("at step 4")) == ("training diverged: at step 4", False)


def test_torchruns_lines_about_failed_and_signalled_workers_are_left_out(caplog):
    from ddpx.launch.torchrun import _quiet_agent

    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    with _quiet_agent():
        logger.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 1, 0, 42, "python")
        logger.warning("Sending process %s closing signal %s", 42, "SIGINT")
        logging.getLogger("torch.distributed.elastic.agent.server.api").warning(
            "Received %s death signal, shutting down workers", 2)
        logger.warning("Unable to shutdown process %s via %s, forcefully exiting via %s", 42, 15, 9)
    err = caplog.text
    assert "exitcode" not in err and "closing signal" not in err and "death signal" not in err, err
    assert "Unable to shutdown process 42" in err  # what ddpx does not say itself stays


def test_a_worker_that_printed_its_error_is_not_repeated_by_the_launcher(tmp_path, capsys):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from ddpx.launch.torchrun import _run_agent

    args = types.SimpleNamespace(local_addr=None, nproc_per_node="2")
    for code, shown in ((2, True), (1, True), (-9, False)):
        def run(_):
            raise ChildFailedError("ddpx.worker", {1: ProcessFailure(1, 4242, code, str(tmp_path / "none"))})

        with pytest.raises(DdpxError) as info:
            _run_agent(run, args, str(tmp_path))
        assert info.value.shown is shown
    run = lambda _: (_ for _ in ()).throw(  # noqa: E731
        ChildFailedError("ddpx.worker", {1: ProcessFailure(1, 4242, 143, str(tmp_path / "none"))}))
    assert _run_agent(run, args, str(tmp_path)) == 143
    assert capsys.readouterr().err == "ddpx: stopped: rank 1 was stopped by SIGTERM\n"


# --- the resume hint and the run directory ------------------------------------------------------


def launch_failing(monkeypatch, project, code=1, raises=None, save=None, overrides=()):
    """``ddpx train cfg.yaml`` with torchrun replaced: it saves checkpoint steps ``save`` in the run
    directory, then returns ``code`` or raises ``raises``."""
    from ddpx.launch import launcher
    from ddpx.launch.options import LaunchOptions

    def fake_torchrun(argv):
        run_dir = Path(next(a for a in argv if a.startswith("run_dir=")).split("=", 1)[1])
        for step in save or ():
            (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
            torch.save({}, run_dir / "checkpoints" / f"step-{step:09d}.pt")
        if raises is not None:
            raise raises
        return code

    monkeypatch.setattr(launcher, "run_torchrun", fake_torchrun)
    opts = LaunchOptions(nproc_per_node="1")
    if raises is not None:
        with pytest.raises(type(raises)):
            launcher.launch("cfg.yaml", list(overrides), opts)
    else:
        assert launcher.launch("cfg.yaml", list(overrides), opts) == code


def test_no_resume_hint_and_no_run_dir_when_nothing_was_saved(project, monkeypatch, capsys):
    launch_failing(monkeypatch, project, code=1)
    assert "to resume" not in capsys.readouterr().err
    assert not (project / "runs").exists()  # the launch made runs/ and runs/<time>: both gone
    bad = DdpxError("optimizer: torch.optim.SGD(lr=-0.1) failed")
    launch_failing(monkeypatch, project, raises=bad, overrides=["optimizer.args.lr=-0.1"])
    assert "to resume" not in capsys.readouterr().err
    assert not (project / "runs").exists()


def test_the_resume_hint_comes_with_a_checkpoint(project, monkeypatch, capsys):
    launch_failing(monkeypatch, project, code=130, save=[7], overrides=["trainer.epochs=5"])
    (run_dir,) = (project / "runs").iterdir()
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"ddpx: to resume this run: ddpx train cfg.yaml trainer.epochs=5 run_dir={run_dir}"
    # Resumed with a bad override that fails at set-up: no hint repeating it, nothing removed.
    bad = DdpxError("optimizer: torch.optim.SGD(lr=-0.1) failed")
    launch_failing(monkeypatch, project, raises=bad, overrides=["optimizer.args.lr=-0.1", f"run_dir={run_dir}"])
    assert "to resume" not in capsys.readouterr().err
    assert (run_dir / "checkpoints" / "step-000000007.pt").exists()
    # Bad input found after a new checkpoint (a full disk at the next save): resumable.
    launch_failing(monkeypatch, project, raises=DdpxError("checkpoint not saved: no space left on device"),
                   save=[14], overrides=[f"run_dir={run_dir}"])
    assert "ddpx: to resume this run:" in capsys.readouterr().err


def test_a_failed_launch_keeps_whatever_was_saved(project, monkeypatch):
    from ddpx.launch import launcher
    from ddpx.launch.options import LaunchOptions

    def fake_torchrun(argv):
        run_dir = Path(next(a for a in argv if a.startswith("run_dir=")).split("=", 1)[1])
        (run_dir / "metrics.jsonl").write_text('{"kind": "epoch"}\n')
        (run_dir / "tb").mkdir()
        return 1

    monkeypatch.setattr(launcher, "run_torchrun", fake_torchrun)
    assert launcher.launch("cfg.yaml", [], LaunchOptions(nproc_per_node="1")) == 1
    (run_dir,) = (project / "runs").iterdir()
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]


# --- the smoke run ----------------------------------------------------------------------------


def test_the_smoke_run_crosses_epochs_and_finds_the_projects_plugins(project, monkeypatch):
    from ddpx.smoke import rank as smoke_rank

    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(project))])
    config = smoke_rank.load_smoke_config("cfg.yaml", ["plugins.enable=[epoch1plug]"], [])
    assert config.plugin_manager.get_plugin("epoch1plug") is not None
    overrides = dict(o.split("=", 1) for o in smoke_rank._smoke_overrides(config, 2))
    assert overrides["trainer.epochs"] == "3"
    assert '"train_samples": 64' in overrides["data.args"]  # 2 ranks x 16 x 2 steps: 2 steps an epoch
    assert smoke_rank.TRAIN_STEPS > smoke_rank.STEPS_PER_EPOCH  # the first train stage reaches epoch 1


# --- as a user meets them: the ddpx train command in a project directory ------------------------


def ddpx_train(ranks, project, *args, timeout=150):
    script = os.path.join(os.path.dirname(sys.executable), "ddpx")
    rc, out, err = ranks.cli(["train", "cfg.yaml", *args], timeout=timeout, cwd=project,
                             script=script if os.path.exists(script) else None)
    return rc, out + err


def terminal_lines(text: str) -> list[str]:
    """The lines a terminal shows (a carriage return starts the line over)."""
    return [line.rsplit("\r", 1)[-1] for line in text.splitlines() if line.rsplit("\r", 1)[-1].strip()]


@pytest.mark.slow
def test_a_config_mistake_found_by_the_workers_is_one_line(ranks, project):
    rc, out = ddpx_train(ranks, project, "optimizer.args.lr=-0.1")
    assert rc == 2, out
    assert terminal_lines(out) == ["ddpx: error: [rank0] optimizer: torch.optim.SGD(lr=-0.1) failed: ValueError: "
                                   "Invalid learning rate: -0.1; fix optimizer.args"] or \
        terminal_lines(out) == ["ddpx: error: [rank1] optimizer: torch.optim.SGD(lr=-0.1) failed: ValueError: "
                                "Invalid learning rate: -0.1; fix optimizer.args"], out
    assert not (project / "runs").exists()


@pytest.mark.slow
def test_a_plugin_raising_in_a_worker_is_one_line_and_the_run_resumable(ranks, project):
    rc, out = ddpx_train(ranks, project, "plugins.enable=[epoch1plug]")
    assert rc == 1, out
    errors = [line for line in terminal_lines(out) if not line.startswith("[rank0] ")]  # the epoch 0 log
    assert len(errors) == 2, out
    assert errors[0].startswith("ddpx: error: [rank") and errors[0].endswith(
        "] plugin 'epoch1plug' raised in ddpx_epoch_start: RuntimeError: metrics.csv is missing; create it "
        "(epoch1plug.py:8)"), out
    (run_dir,) = (project / "runs").iterdir()
    assert errors[1] == f"ddpx: to resume this run: ddpx train cfg.yaml 'plugins.enable=[epoch1plug]' run_dir={run_dir}"


@pytest.mark.slow
def test_an_unexpected_error_shows_its_traceback_once(ranks, project):
    rc, out = ddpx_train(ranks, project, "model.target=mymodels.Broken")
    assert rc == 1, out
    assert out.count("Traceback (most recent call last)") == 1, out
    assert 'mymodels.py", line 17, in forward' in out, out
    assert out.count("mat1 and mat2 shapes cannot be multiplied") == 2, out  # the traceback's last line, and ours
    assert "exitcode" not in out and "to resume" not in out, out


@pytest.mark.slow
def test_a_failing_smoke_run_is_a_line_per_rank_then_its_table(ranks, project):
    script = os.path.join(os.path.dirname(sys.executable), "ddpx")
    rc, table, err = ranks.cli(["train", "cfg.yaml", "--smoke", "plugins.enable=[epoch1plug]"], timeout=150,
                               cwd=project, script=script if os.path.exists(script) else None)
    out = err + table
    assert rc == 1, out
    failures = [line for line in terminal_lines(err) if not line.startswith("[rank0] ")]  # its epoch 0 log
    assert sorted(failures) == [f"ddpx: smoke: [rank{r}] FAIL at train: plugin 'epoch1plug' raised in "
                                "ddpx_epoch_start: RuntimeError: metrics.csv is missing; create it (epoch1plug.py:8)"
                                for r in (0, 1)], out
    assert "Traceback" not in out and "exitcode" not in out, out
    assert terminal_lines(table)[-2].startswith(
        "smoke run FAILED at train: plugin 'epoch1plug' (ddpx_epoch_start); tracebacks: ")
    assert glob.glob(str(project / "runs" / "smoke-*" / "smoke" / "rank1.traceback"))


@pytest.mark.slow
def test_ctrl_c_through_tee_saves_the_stop_says_how_to_resume_and_resumes_exactly(ranks, project):
    """``ddpx train ... 2>&1 | tee train.log`` and Ctrl-C: the terminal's SIGINT ends tee first, and
    the launcher and its workers then wrote into a pipe nobody read (BrokenPipeError): they died
    without the stop's checkpoint, and the stop and resume lines went nowhere. Now the stop goes
    on as in a terminal; its lines are in the run's console.log; the resume goes on at that step."""
    script = os.path.join(os.path.dirname(sys.executable), "ddpx")
    ddpx = script if os.path.exists(script) else f"{sys.executable} -m ddpx"
    pipeline = f"{ddpx} train cfg.yaml trainer.epochs=500 2>&1 | tee train.log; echo ${{PIPESTATUS[@]}} > status"
    proc = harness.start(["bash", "-c", pipeline], project / "terminal.log", harness.base_env(), cwd=project)
    try:
        harness.wait_for(lambda: glob.glob(str(project / "runs" / "*" / "checkpoints" / "*.pt")), 120, poll=0.2)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the launcher and tee get SIGINT
        harness.wait_for(lambda: proc.poll() is not None, 90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    (run_dir,) = (project / "runs").iterdir()
    console = (run_dir / "console.log").read_text()
    assert (project / "status").read_text().split() == ["130", "130"], console  # ddpx's 130; tee killed by SIGINT
    assert "death signal" not in console and "closing signal" not in console and "Traceback" not in console, console
    lines = terminal_lines(console)
    saved = re.fullmatch(r"\[rank0\] saved checkpoint (\S+) \(in epoch (\d+), step (\d+)\)", lines[-3])
    assert saved and lines[-2:] == ["ddpx: stopped by SIGINT",
                                    f"ddpx: to resume this run: ddpx train cfg.yaml trainer.epochs=500 run_dir={run_dir}"], console
    path, epoch, step = saved[1], int(saved[2]), int(saved[3])
    assert Path(path).exists(), saved[0]

    rc, out, err = ranks.cli(["train", "cfg.yaml", f"trainer.epochs={epoch + 1}", f"run_dir={run_dir}"], timeout=120,
                             cwd=project)
    assert rc == 0, out + err
    assert f"[rank0] resumed from {path} (epoch {epoch}, step {step})" in err, err
    # the rest of the interrupted epoch, not more and not less: it ends at its own last step
    assert f"[rank0] epoch {epoch} (step {6 * (epoch + 1)}): " in err, err


def test_a_worker_prints_its_failure_once_per_node_and_the_traceback_on_request(monkeypatch, capsys):
    from ddpx.plugin.manager import ORIGIN_ATTRIBUTE
    from ddpx.worker import report_failure

    try:
        raise RuntimeError("metrics.csv is missing")
    except RuntimeError as caught:
        exc = caught
    setattr(exc, ORIGIN_ATTRIBUTE, ("epoch1plug", "ddpx_epoch_start"))
    trainer = types.SimpleNamespace(peer_failure=None, failure_store=torch.distributed.HashStore())
    monkeypatch.delenv("DDPX_TRACEBACK", raising=False)
    monkeypatch.setenv("GROUP_RANK", "0")
    monkeypatch.setenv("RANK", "1")
    report_failure(exc, trainer, "1")
    err = capsys.readouterr().err
    assert err.startswith("ddpx: error: [rank1] plugin 'epoch1plug' raised in ddpx_epoch_start: RuntimeError: "
                          "metrics.csv is missing (test_user_errors.py:") and err.count("\n") == 1, err
    monkeypatch.setenv("RANK", "0")
    report_failure(exc, trainer, "0")  # rank 0 of the same node, failing later: silent
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("DDPX_TRACEBACK", "1")
    report_failure(exc, trainer, "0")  # the traceback on request, from every rank
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "ddpx: error:" not in err, err


def test_a_dataloader_worker_forked_with_the_stop_handler_leaves_ctrl_c_to_its_rank():
    """Ctrl-C reaches the terminal's whole process group: every DataLoader worker, forked with the
    rank's SIGINT handler, said 'received SIGINT' too (10 lines for 2 ranks x 4 workers), and its
    exit left an atexit traceback per rank. A forked worker must ignore it; the rank still acts."""
    import signal

    from ddpx.train.stopping import StopSignals

    class Agreement:
        taking_signals = True
        signals = []

        def on_signal(self, signum):
            self.signals.append(signum)

    trainer = type("T", (), {"stop_agreement": Agreement()})()
    handler = StopSignals(trainer)
    pid = os.fork()
    if pid == 0:  # the "DataLoader worker": nothing reaches the agreement, no exception
        try:
            handler.on_signal(signal.SIGINT, None)
            os._exit(0 if not trainer.stop_agreement.signals else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    previous = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        handler.on_signal(signal.SIGINT, None)  # the rank itself
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])
    assert trainer.stop_agreement.signals == [signal.SIGINT]

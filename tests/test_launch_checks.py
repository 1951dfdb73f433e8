"""Bad input is caught at launch, before any worker starts: one line, exit 2 (issue 28, finding 3 and 6)."""

import os
import shutil
import textwrap

import pytest

from ddpx.cli import build_parser, main
from ddpx.config import load_config
from ddpx.errors import DdpxError
from ddpx.launch.launcher import launch
from ddpx.launch.options import LaunchOptions, check_options
from ddpx.launch.preflight import check_run_dir
from ddpx.launch.resume import newest_run, resume_command


def one_line_error(fn, *args, **kwargs) -> str:
    with pytest.raises(DdpxError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("override, words", [
    ("trainer.batch_size=0", "'trainer.batch_size' must be >= 1"),
    ("trainer.batch_size=-4", "'trainer.batch_size' must be >= 1"),
    ("trainer.epochs=-1", "'trainer.epochs' must be >= 1"),
    ("trainer.epochs=0", "'trainer.epochs' must be >= 1"),
    ("trainer.max_steps=0", "'trainer.max_steps' must be >= 1"),
    ("trainer.num_workers=-1", "'trainer.num_workers' must be >= 0"),
    ("trainer.timeout_s=0", "'trainer.timeout_s' must be > 0"),
    ("launch.nproc_per_node=0", "launch.nproc_per_node must be a number of processes >= 1"),
    ("launch.nproc_per_node=abc", "launch.nproc_per_node must be a number of processes >= 1"),
    ("launch.nnodes=0", "'launch.nnodes' must be a number of nodes"),
])
def test_numbers_out_of_range_are_one_line_errors(override, words):
    assert words in one_line_error(load_config, None, [override])


@pytest.mark.parametrize("opts, words", [
    (LaunchOptions(nproc_per_node="0"), "--nproc-per-node must be a number of processes >= 1"),
    (LaunchOptions(nproc_per_node="-2"), "--nproc-per-node must be a number of processes >= 1"),
    (LaunchOptions(nproc_per_node="abc"), "--nproc-per-node must be a number of processes >= 1, auto, gpu or cpu, got 'abc'"),
    (LaunchOptions(master_port=99999), "--master-port must be a port number from 1 to 65535, got 99999"),
    (LaunchOptions(master_port=0), "--master-port must be a port number from 1 to 65535"),
    (LaunchOptions(max_restarts=-1), "--max-restarts must be >= 0"),
    (LaunchOptions(nnodes="0:2"), "--nnodes must be a number of nodes"),
])
def test_bad_launch_options_are_one_line_errors(opts, words):
    assert words in one_line_error(check_options, opts)


def test_the_cli_refuses_bad_options_before_starting_anything(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", f"run_dir={run_dir}", "--nproc-per-node", "0"]) == 2
    assert main(["train", f"run_dir={run_dir}", "--master-port", "99999"]) == 2
    err = capsys.readouterr().err
    assert "--nproc-per-node must be" in err and "--master-port must be" in err and "Traceback" not in err
    assert not run_dir.exists()  # nothing started, nothing written


def test_an_unwritable_run_dir_is_refused_at_launch(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    config = load_config(None, [f"run_dir={blocker / 'run'}"])
    message = one_line_error(check_run_dir, str(blocker / "run"), config)
    assert "is not writable" in message and "run_dir=DIR" in message


def test_too_little_free_space_is_refused_at_launch(tmp_path, monkeypatch):
    config = load_config(None, ["model.args.hidden=128"])
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12, 1000))
    message = one_line_error(check_run_dir, str(tmp_path / "run"), config)
    assert "has 0 MB free, a checkpoint needs about" in message


def test_overrides_may_follow_the_options(monkeypatch):
    seen = {}
    monkeypatch.setattr("ddpx.cli.train.launch", lambda config, overrides, opts: seen.update(
        config=config, overrides=overrides, nproc=opts.nproc_per_node) or 0)
    assert main(["train", "trainer.epochs=1", "--nproc-per-node", "1", "logging.progress=false"]) == 0
    assert seen == {"config": None, "overrides": ["trainer.epochs=1", "logging.progress=false"], "nproc": "1"}
    with pytest.raises(SystemExit):  # anything else is still argparse's one-line error
        main(["train", "trainer.epochs=1", "--nproc-per-node", "1", "--no-such-option"])


def test_a_section_override_merges_into_the_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer: {epochs: 1}\n")  # no optimizer section
    config = load_config(str(path), ["optimizer.args.lr=0.05"])
    assert config.optimizer.target == "torch.optim.SGD"
    assert config.optimizer.args == {"lr": 0.05, "momentum": 0.9}
    adam = load_config(str(path), ["optimizer.target=torch.optim.Adam", "optimizer.args.lr=0.05"])
    assert adam.optimizer.args == {"lr": 0.05}  # another target: SGD's momentum stays out


def test_resume_finds_the_newest_run_of_this_config(tmp_path, monkeypatch):
    import json

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text("trainer: {epochs: 1}\n")
    for name, started, cfg in [("a", 1, str(config)), ("b", 3, str(config)), ("c", 5, "/elsewhere.yaml")]:
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "ddpx-launch.json").write_text(json.dumps({"config": cfg, "started": started}))
    assert newest_run("c.yaml") == str(tmp_path / "runs" / "b")
    assert "no run of" in one_line_error(newest_run, "other.yaml")
    assert resume_command("c.yaml", ["trainer.epochs=2", "run_dir=/x"], "/r") == \
        "ddpx train c.yaml trainer.epochs=2 run_dir=/r"


def test_train_synopsis_in_docs_names_every_option():
    parser = build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]
    options = [o for a in train._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    docs = open(os.path.join(os.path.dirname(__file__), "..", "docs", "config.md")).read()
    synopsis = docs[docs.index("ddpx train [CONFIG]"):][:1500]
    missing = [o for o in options if o not in synopsis]
    assert not missing, f"options missing from the `ddpx train` synopsis in docs/config.md: {missing}"


# --- oversubscription: one warning line at launch, with the fix (issue 40, item 3) --------------------


@pytest.mark.parametrize("nproc, omp, said", [
    ("3", "1", "3 workers x 1 thread (OMP_NUM_THREADS) on 2 CPU cores: oversubscribed, every collective waits "
               "for a worker without a core; use --nproc-per-node 2 (or fewer)"),
    ("2", "2", "2 workers x 2 threads (OMP_NUM_THREADS) on 2 CPU cores: oversubscribed, every collective waits "
               "for a worker without a core; set OMP_NUM_THREADS=1"),
    ("2", "1", None),
    ("1", "2", None),
])
def test_workers_that_oversubscribe_the_cpus_are_one_warning_at_launch(tmp_path, monkeypatch, capsys, nproc, omp,
                                                                        said):
    """`--nproc-per-node 3` on a 2-core machine trained without a word."""
    import torch

    started = []
    monkeypatch.setattr("ddpx.launch.launcher.run_torchrun", lambda argv: started.append(argv) or 0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("OMP_NUM_THREADS", omp)
    assert main(["train", f"run_dir={tmp_path / 'run'}", "--nproc-per-node", nproc]) == 0
    assert started and f"--nproc-per-node={nproc}" in started[0]  # a warning, not an error: training starts
    assert capsys.readouterr().err.splitlines() == ([f"ddpx: warning: {said}"] if said else [])


@pytest.mark.parametrize("overrides, nproc, said", [
    ([], 3, "3 workers but 2 GPUs: trainer.device=auto trains on the CPU (gloo) unless every worker has its own "
            "GPU; use --nproc-per-node 2 to train on the GPUs"),
    (["trainer.device=cuda"], 3, "3 workers share 2 GPUs: ranks on one GPU take turns and every collective waits "
                                 "for them; use --nproc-per-node 2"),
    ([], 2, None),
    (["trainer.device=cuda"], 2, None),
])
def test_more_workers_than_gpus_is_said_with_the_fix(overrides, nproc, said):
    from ddpx.launch.preflight import oversubscription

    trainer_cfg = load_config(None, overrides).trainer
    assert oversubscription(nproc, trainer_cfg, cores=64, gpus=2, threads="1") == said

"""A plugin package installed into a fresh environment is discovered through its
entry point, gets its config section, and its hooks run on every rank; a strategy it
ships (the local SGD example, entry-point group ``ddpx.strategies``) is chosen by name."""

import json
import os
import pathlib
import shutil
import site
import sys
import textwrap

import pytest

PLUGIN = '''
"""A third-party ddpx plugin: records what it saw, one file per rank."""
import json
import os

from ddpx import hookimpl


def _record(trainer, **event):
    cfg = trainer.config.section("hello")
    path = os.path.join(trainer.run_dir, f"hello-rank{trainer.rank}.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps({"greeting": cfg["greeting"], **event}) + "\\n")


@hookimpl
def ddpx_config_defaults():
    return {"hello": {"greeting": "hi", "times": 1}}


@hookimpl
def ddpx_train_start(trainer):
    _record(trainer, event="train_start", world_size=trainer.world_size)


@hookimpl
def ddpx_epoch_end(trainer, epoch, metrics):
    _record(trainer, event="epoch_end", epoch=epoch, accuracy=metrics.get("accuracy"))


@hookimpl
def ddpx_train_end(trainer):
    _record(trainer, event="train_end", step=trainer.global_step)
'''

PYPROJECT = '''
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "ddpx-hello-plugin"
version = "0.3.1"
dependencies = ["ddpx"]

[project.entry-points.ddpx]
hello = "ddpx_hello"

[project.entry-points."ddpx.strategies"]
hello_local_sgd = "ddpx_hello_sgd:LocalSGD"

[tool.setuptools]
py-modules = ["ddpx_hello", "ddpx_hello_sgd"]
'''


@pytest.mark.slow
def test_installed_plugin_is_discovered_and_called(ranks, tmp_path):
    package = tmp_path / "ddpx-hello-plugin"
    package.mkdir()
    (package / "ddpx_hello.py").write_text(textwrap.dedent(PLUGIN))
    (package / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    shutil.copy(pathlib.Path(__file__).parent.parent / "examples" / "local_sgd" / "local_sgd.py",
                package / "ddpx_hello_sgd.py")
    venv = tmp_path / "venv"
    # --without-pip: this interpreter's pip (seen through its site-packages) installs into the venv.
    code, _, err = ranks.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
                             timeout=60)
    assert code == 0, err
    python = str(venv / "bin" / "python")
    # torch, ddpx, pip and setuptools come from this interpreter's site-packages (no
    # network). When this interpreter is itself a venv, --system-site-packages shows
    # the base interpreter's packages instead, so a .pth file adds ours (their own
    # .pth files, e.g. an editable ddpx, processed too), ahead of the base's.
    code, site_dir, err = ranks.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                    timeout=60)
    assert code == 0, err
    site_dir = site_dir.strip()
    outer = [d for d in site.getsitepackages() if os.path.isdir(d)]
    (pathlib.Path(site_dir) / "outer_env.pth").write_text(
        "".join(f"import site; site.addsitedir({d!r})\n" for d in outer))
    code, _, err = ranks.run(
        [python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--quiet", str(package)],
        timeout=120)
    assert code == 0, err

    rc, out, err = ranks.cli(["plugins"], python=python, timeout=60)
    assert rc == 0, err
    row = next(line for line in out.splitlines() if line.startswith("hello "))
    assert row.split() == ["hello", "ddpx-hello-plugin", "0.3.1", "ddpx_config_defaults,", "ddpx_epoch_end,", "ddpx_train_end,", "ddpx_train_start"]
    assert out.splitlines()[-1] == ("strategy: ddp (ddpx.strategies.ddp.DDPStrategy); built in: ddp, fsdp, pipeline, tensor; "
                                    "installed: hello_local_sgd (ddpx-hello-plugin 0.3.1)")

    run_dir = tmp_path / "run"
    rc, out, err = ranks.cli(
        ["train", "trainer.epochs=2", "hello.greeting=hey", f"run_dir={run_dir}", "logging.progress=false"],
        python=python, timeout=120, cwd=tmp_path,
    )
    assert rc == 0, err[-3000:]
    for rank in (0, 1):
        events = [json.loads(line) for line in (run_dir / f"hello-rank{rank}.jsonl").read_text().splitlines()]
        assert [e["event"] for e in events] == ["train_start", "epoch_end", "epoch_end", "train_end"]
        assert {e["greeting"] for e in events} == {"hey"}  # its config section, overridden on the CLI
        assert events[0]["world_size"] == 2
        assert [e.get("epoch") for e in events[1:3]] == [0, 1]
        assert events[2]["accuracy"] > 0.5
        assert events[3]["step"] == 46  # 2 epochs x 23 steps (2 ranks x 32 per batch)

    # The package's strategy, by the name it registers, with its own config section.
    run_dir = tmp_path / "run-sgd"
    rc, out, err = ranks.cli(["train", "trainer.epochs=1", "trainer.strategy=hello_local_sgd", "local_sgd.every_steps=5",
                              f"run_dir={run_dir}", "logging.progress=false"], python=python, timeout=120, cwd=tmp_path)
    assert rc == 0, err[-3000:]
    assert "local SGD: the weights are averaged every 5 optimizer steps" in err

    # Outside that environment the plugin does not exist.
    rc, out, err = ranks.cli(["train", "hello.greeting=hey"], timeout=60, cwd=tmp_path)
    assert rc == 2 and "unknown key 'hello'" in err

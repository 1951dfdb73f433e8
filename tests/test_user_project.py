"""A user's own project: their model and data modules next to their YAML, imported
without PYTHONPATH, whether ``ddpx train`` runs in that directory or elsewhere."""

import json
import os
import shutil
import sys
import textwrap

import pytest

MYMODEL = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2))

    def forward(self, x):
        return self.net(x)


def make_data(n=256):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()  # linearly separable
    data = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.Subset(data, range(192)), torch.utils.data.Subset(data, range(192, n))
'''

CONFIG = '''
model: {target: mymodel.Net, args: {hidden: 16}}
data: {target: mymodel.make_data}
optimizer: {target: torch.optim.SGD, args: {lr: 0.2, momentum: 0.9}}
trainer: {epochs: 4, batch_size: 16}
launch: {nproc_per_node: 2}
logging: {progress: false}
checkpoint: {enabled: false}
'''


def ddpx_command():
    """The installed ``ddpx`` script (not ``python -m ddpx``, which would put the current directory on sys.path)."""
    script = os.path.join(os.path.dirname(sys.executable), "ddpx")
    return script if os.path.exists(script) else shutil.which("ddpx")


@pytest.mark.slow
@pytest.mark.parametrize("where", ["project", "elsewhere"])
def test_user_modules_import_without_pythonpath(ranks, tmp_path, where):
    script = ddpx_command()
    if script is None:
        pytest.skip("no installed ddpx script")
    project = tmp_path / "myproject"
    project.mkdir()
    (project / "mymodel.py").write_text(textwrap.dedent(MYMODEL))
    (project / "cfg.yaml").write_text(textwrap.dedent(CONFIG))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cwd, config = (project, "cfg.yaml") if where == "project" else (elsewhere, str(project / "cfg.yaml"))
    rc, out, err = ranks.cli(["train", config, f"run_dir={tmp_path / 'run'}"], timeout=120, cwd=cwd,
                           script=script, env={"PYTHONPATH": None})
    assert rc == 0, err[-3000:]
    epochs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    epochs = [e for e in epochs if e["kind"] == "epoch"]
    assert len(epochs) == 4
    assert epochs[-1]["loss"] < epochs[0]["loss"]
    assert epochs[-1]["accuracy"] > 0.9


def test_user_module_dirs_precedence(tmp_path, monkeypatch):
    from ddpx.config import user_module_dirs

    monkeypatch.chdir(tmp_path)
    (tmp_path / "proj").mkdir()
    assert user_module_dirs(str(tmp_path / "proj" / "cfg.yaml")) == [str(tmp_path / "proj"), str(tmp_path)]
    assert user_module_dirs("cfg.yaml") == [str(tmp_path)]  # config in the current directory: one entry
    assert user_module_dirs(None) == [str(tmp_path)]

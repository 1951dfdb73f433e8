"""Strategies (ddpx/strategies/, docs/strategies.md): ``trainer.strategy`` resolves to one object
the trainer and the plugins ask; no code outside the strategies compares a strategy's name; a
strategy of one's own is one file plus one config line (local SGD, examples/local_sgd/, on 2
ranks as a user runs it)."""

import ast
import json
import pathlib
import shutil

import pytest
import torch

from ddpx.config import load_config
from ddpx.config.strategies import BUILTIN_STRATEGIES, strategy_class
from ddpx.errors import DdpxError
from ddpx.strategies import Strategy, make
from ddpx.strategies.ddp import DDPStrategy
from ddpx.strategies.fsdp import FSDPStrategy

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "local_sgd"
STRATEGY_HOMES = {ROOT / "ddpx" / "strategies", ROOT / "ddpx" / "config" / "strategies.py"}


def _names_a_strategy(node: ast.Compare) -> bool:
    """A comparison one of whose sides is a strategy's name: ``...strategy``, ``...strategy.name``, a
    built-in strategy's name as a string (or a tuple, list or set of such)."""
    for side in [node.left, *node.comparators]:
        if isinstance(side, ast.Attribute) and (side.attr == "strategy" or (
                side.attr == "name" and isinstance(side.value, ast.Attribute) and side.value.attr == "strategy")):
            return True
        if isinstance(side, ast.Name) and side.id == "strategy":
            return True
        constants = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
        if any(isinstance(c, ast.Constant) and c.value in BUILTIN_STRATEGIES for c in constants):
            return True
    return False


def _is_none_test(node: ast.Compare) -> bool:
    """``x is None`` / ``x is not None``: whether a strategy exists, not which one."""
    return all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops) and \
        all(isinstance(c, ast.Constant) and c.value is None for c in node.comparators)


def strategy_name_comparisons(roots) -> list:
    """``path:line`` of every comparison (``==``, ``!=``, ``in``, ``is``) that involves a strategy's name,
    and of every use of a built-in strategy's class, in the Python files under ``roots`` outside the
    strategies' own modules."""
    found = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if any(path == home or home in path.parents for home in STRATEGY_HOMES):
                continue
            where = path.relative_to(ROOT) if ROOT in path.parents else path
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Compare) and _names_a_strategy(node) and not _is_none_test(node):
                    found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
                elif isinstance(node, ast.Name) and node.id in ("DDPStrategy", "FSDPStrategy"):
                    found.append(f"{where}:{node.lineno}: {node.id}")
    return found


def test_no_code_outside_the_strategies_compares_a_strategy_name():
    assert strategy_name_comparisons([ROOT / "ddpx", ROOT / "plugins"]) == []


def test_the_name_check_finds_what_it_is_for(tmp_path):
    code = tmp_path / "pkg"
    code.mkdir()
    (code / "a.py").write_text("def f(config, trainer):\n"
                               "    if config.trainer.strategy == 'fsdp':\n        pass\n"
                               "    return trainer.strategy.name in ('x',) or isinstance(trainer.strategy, FSDPStrategy)\n"
                               "def g(mode, strategy):\n    return mode == 'fast' or strategy is None\n")
    found = strategy_name_comparisons([code])
    assert [line.split(": ", 1)[0].rsplit(":", 1)[1] for line in found] == ["2", "4", "4"]


def test_built_in_names_and_import_paths_resolve(make_config):
    assert strategy_class("ddp") is DDPStrategy and strategy_class("fsdp") is FSDPStrategy
    assert strategy_class("ddpx.strategies.ddp:DDPStrategy") is DDPStrategy
    strategy = make(make_config())
    assert type(strategy) is DDPStrategy and strategy.name == "ddp" and strategy.replicated
    assert not make(make_config("trainer.strategy=fsdp")).replicated


@pytest.mark.parametrize("name, message", [
    ("fdsp", r"^unknown trainer.strategy 'fdsp'; did you mean 'fsdp'\?; choose one of ddp, fsdp, pipeline, tensor, or give an "
             r"import path package.module:Class$"),
    ("torch.nn.Linear", r"^trainer.strategy 'torch.nn.Linear' is <class 'torch.nn.modules.linear.Linear'>, not a "
                        r"strategy: subclass ddpx.strategies.Strategy \(docs/strategies.md\)$"),
    ("nosuchmodule.X", r"^trainer.strategy 'nosuchmodule.X' does not resolve: no module named 'nosuchmodule'"),
])
def test_a_name_that_is_no_strategy_is_one_line(name, message):
    with pytest.raises(DdpxError, match=message):
        load_config(None, [f"trainer.strategy={name}"])


def test_an_installed_package_registers_a_strategy_by_entry_point(tmp_path, monkeypatch):
    """A distribution on sys.path whose entry points name a strategy in the group ddpx.strategies."""
    (tmp_path / "mystrat.py").write_text("from ddpx.strategies.ddp import DDPStrategy\n\n\n"
                                         "class Mine(DDPStrategy):\n    pass\n")
    info = tmp_path / "mystrat-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mystrat\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[ddpx.strategies]\nmine = mystrat:Mine\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(None, ["trainer.strategy=mine"])
    assert type(make(config)).__name__ == "Mine"
    with pytest.raises(DdpxError, match="choose one of ddp, fsdp, pipeline, tensor, mine, or give an import path"):
        load_config(None, ["trainer.strategy=other"])


def test_a_strategy_declares_its_config_section_and_checks(tmp_path, monkeypatch):
    shutil.copy(EXAMPLE / "local_sgd.py", tmp_path / "local_sgd.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(None, ["trainer.strategy=local_sgd:LocalSGD", "local_sgd.every_steps=3"])
    assert config.local_sgd.every_steps == 3
    assert load_config(None, ["trainer.strategy=local_sgd:LocalSGD"]).local_sgd.every_steps == 8
    with pytest.raises(DdpxError, match=r"^unknown key 'local_sgd.every' in section 'local_sgd'; did you mean "
                                        r"'local_sgd.every_steps'\?$"):
        load_config(None, ["trainer.strategy=local_sgd:LocalSGD", "local_sgd.every=3"])
    with pytest.raises(DdpxError, match=r"^local_sgd.every_steps must be >= 1 \(optimizer steps between averages\), "
                                        r"got 0$"):
        load_config(None, ["trainer.strategy=local_sgd:LocalSGD", "local_sgd.every_steps=0"])
    with pytest.raises(DdpxError, match=r"^unknown key 'local_sgd' in the config"):  # the ddp strategy has none
        load_config(None, ["local_sgd.every_steps=3"])
    with pytest.raises(DdpxError, match=r"^comm_hook.name=int8 does not apply under trainer.strategy="
                                        r"local_sgd:LocalSGD: it has no gradient exchange a comm hook could compress"):
        load_config(None, ["trainer.strategy=local_sgd:LocalSGD", "comm_hook.name=int8"])


def test_the_base_answers_for_a_replicated_model(make_config):
    class Replicated(Strategy):
        def wrap(self, trainer, module):
            return module

    strategy = Replicated(make_config())
    module = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    assert strategy.no_sync(module) is None and strategy.part_reduction(module) is None
    (value, hint), = strategy.replica_checks(module).values()
    assert value.item() == pytest.approx(sum(p.sum().item() for p in module.parameters()))
    assert "the replicas drifted apart" in hint
    model_state, optimizer_state = strategy.model_state(module, optimizer)
    assert set(model_state) == {"weight", "bias"} and "param_groups" in optimizer_state
    assert strategy.sharded_entries({"model": model_state, "optimizer": optimizer_state}) == ()
    whole = strategy.full_state_dict(module)
    assert whole["weight"].data_ptr() != module.weight.data_ptr() and torch.equal(whole["weight"], module.weight)
    assert strategy.memory(module, optimizer) == {"parameters": 32, "gradients": 0, "optimizer": 0}


LOCAL_SGD_CONFIG = """
trainer: {strategy: local_sgd:LocalSGD, epochs: 3}
local_sgd: {every_steps: 3}
launch: {nproc_per_node: 2}
logging: {progress: false}
checkpoint: {enabled: false}
plugins: {enable: [weights]}
"""

# Writes each rank's weights at every epoch end: equal right after an average, apart after local steps.
WEIGHTS_PLUGIN = """
import torch
from ddpx import hookimpl


@hookimpl
def ddpx_epoch_end(trainer, epoch, metrics):
    flat = torch.cat([p.detach().reshape(-1) for p in trainer.module.parameters()])
    torch.save(flat, trainer.run_dir / f"weights-epoch{epoch}-rank{trainer.rank}.pt")
"""


@pytest.mark.slow
def test_local_sgd_is_one_file_beside_the_config(ranks, tmp_path):
    """The example as a user runs it: local_sgd.py and a YAML in a project directory, ``ddpx train``
    on 2 ranks. Epochs of 23 steps, an average every 3: epoch 0 ends at step 23, two local steps
    after the average at 21 (the replicas are apart), epoch 2 at step 69, right after one (equal).
    The epoch-end weight check runs (trainer.check_collectives) and does not stop the run."""
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(EXAMPLE / "local_sgd.py", project / "local_sgd.py")
    (project / "weights.py").write_text(WEIGHTS_PLUGIN)
    (project / "cfg.yaml").write_text(LOCAL_SGD_CONFIG)
    run_dir = tmp_path / "run"
    rc, out, err = ranks.cli(["train", "cfg.yaml", f"run_dir={run_dir}"], timeout=180, cwd=project,
                             env={"PYTHONPATH": None})
    assert rc == 0, err[-3000:]
    assert "local SGD: the weights are averaged every 3 optimizer steps" in err
    epochs = [e for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if e["kind"] == "epoch"]
    assert [e["step"] for e in epochs] == [23, 46, 69]
    assert epochs[-1]["accuracy"] > 0.85 and epochs[-1]["loss"] < epochs[0]["loss"] / 4  # it learns
    weights = {(e, r): torch.load(run_dir / f"weights-epoch{e}-rank{r}.pt") for e in (0, 2) for r in (0, 1)}
    assert 0 < (weights[0, 0] - weights[0, 1]).abs().max() < 0.1  # apart, by two local steps only
    assert torch.equal(weights[2, 0], weights[2, 1])


def test_the_example_in_the_docs_is_the_file():
    docs = (ROOT / "docs" / "strategies.md").read_text()
    assert (EXAMPLE / "local_sgd.py").read_text() in docs

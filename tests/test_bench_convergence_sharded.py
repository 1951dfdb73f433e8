"""benchmarks/bench_convergence_sharded.py without training: the table and verdicts from
cells already in a work directory, a changed command not read back, and the user's own
project it writes (importable, its model and data fit together)."""

import json
import sys

import pytest
import torch

import harness

bench = harness.benchmark("bench_convergence_sharded")


def _cells(workdir, project, steps, losses):
    """cell.json files as a finished run leaves them: {strategy: [loss per seed]}."""
    for strategy, by_seed in losses.items():
        for seed, loss in enumerate(by_seed):
            run_dir = workdir / f"{project}-{steps}-{strategy}-s{seed}"
            run_dir.mkdir(parents=True)
            cmd = ["ddpx", "train", "config.yaml", "--nproc-per-node", "2", f"seed={seed}", *bench.STRATEGIES[strategy],
                   *bench.PROJECTS[project][1](steps), "logging.progress=false", "checkpoint.enabled=false"]
            (run_dir / "cell.json").write_text(json.dumps({"command": cmd, "eval_loss": loss, "seconds": 1.0}))


def test_the_table_and_the_verdicts_come_from_the_cells(tmp_path, capsys):
    _cells(tmp_path, "char_gpt", 20, {"ddp": [2.0, 2.1, 2.2], "fsdp": [2.01, 2.09, 2.23],
                                      "fsdp_int8": [2.05, 2.15, 2.25]})
    code = bench.main(["--projects", "char_gpt", "--steps", "char_gpt=20", "--workdir", str(tmp_path),
                       "--out", str(tmp_path / "out.json")])
    row = json.loads((tmp_path / "out.json").read_text())["rows"][0]
    fsdp, int8 = row["strategies"]["fsdp"], row["strategies"]["fsdp_int8"]
    assert fsdp["deltas"] == pytest.approx([0.01, -0.01, 0.03]) and fsdp["delta"] == pytest.approx(0.01)
    assert fsdp["meets_target"] and not int8["meets_target"] and int8["delta"] == pytest.approx(0.05)
    assert code == 1  # a miss
    out = capsys.readouterr().out
    assert "| mean | 2.1000 | 2.1100 | 2.1500 | **+0.0100** | **+0.0500** |" in out
    assert "fsdp meets 0.02; fsdp_int8 MISSES 0.03" in out


def test_a_cell_run_with_another_command_is_not_read_back(tmp_path, monkeypatch):
    _cells(tmp_path, "char_gpt", 20, {"ddp": [2.0]})
    cell = tmp_path / "char_gpt-20-ddp-s0" / "cell.json"
    stale = json.loads(cell.read_text())
    stale["command"][-1] = "checkpoint.enabled=true"
    cell.write_text(json.dumps(stale))
    ran = []
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd, **kw: ran.append(cmd) or
                        type("Done", (), {"returncode": 2, "stderr": "config error", "stdout": ""})())
    with pytest.raises(SystemExit, match="exited 2"):
        bench.run_cell("char_gpt", "ddp", 0, 20, str(tmp_path), timeout=5)
    assert ran and "trainer.max_steps=20" in ran[0]


def test_the_users_own_project_is_importable_and_its_parts_fit(tmp_path, monkeypatch):
    config = bench.write_own_project(str(tmp_path / "own_lm"))
    monkeypatch.syspath_prepend(str(tmp_path / "own_lm"))
    for name in ("lm", "corpus"):
        sys.modules.pop(name, None)
    import corpus
    import lm

    train, val = corpus.load(bench.OWN_CONFIG["data"]["args"]["path"], context=32)
    inputs, targets = torch.stack([train[i][0] for i in range(4)]), torch.stack([train[i][1] for i in range(4)])
    logits = lm.CharLM(context=32)(inputs)
    assert logits.shape == (4, 32, 128) and len(val) > 0 and (inputs[:, 1:] == targets[:, :-1]).all()
    assert 4.0 < float(lm.SequenceLoss()(logits, targets).detach()) < 6.0  # about log(128) at initialization
    assert open(config).read().startswith("seed: 0")

"""The examples, copied out of the repository as a user would, run as short smoke
runs of their own configs (only sizes and step counts overridden)."""

import importlib.util
import json
import os
import shutil
import sys

import pytest
import yaml

from ddpx.errors import DdpxError

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def copy_example(name, tmp_path):
    target = tmp_path / name
    shutil.copytree(os.path.join(EXAMPLES, name), target)
    return target


def lines(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_char_gpt_smoke(ranks, tmp_path):
    example = copy_example("char_gpt", tmp_path)
    run_dir = tmp_path / "run"
    rc, out, err = ranks.cli(["train", "config.yaml", f"run_dir={run_dir}", "logging.every_steps=5", "model.args={n_layer: 2, n_head: 4, n_embd: 128, dropout: 0.0}",
                            "trainer.max_steps=20", "scheduler.args={warmup_steps: 5, total_steps: 20}"],
                           cwd=example, timeout=120)
    assert rc == 0, err[-3000:]
    assert "comm hook powersgd installed" in err
    # what a short trial gets from powersgd's defaults, said once (rank 0) at registration
    notes = [line for line in err.splitlines() if "comm hook powersgd: " in line]
    assert notes == ["[rank0] comm hook powersgd: exact fp32 allreduce for the first 100 steps, compressing from "
                     "step 100 (option warmup_steps; comm_hook.options.warmup_steps in a ddpx config)"]
    # a log file is not a terminal: no bar redraws piling up in it (the bar's count to max_steps:
    # test_builtin_plugins.py, test_a_run_ends_with_a_summary_and_its_bar_counts_to_max_steps)
    assert "%|" not in err and "\r" not in err
    summary = err.strip().splitlines()[-1]
    assert summary.startswith("[rank0] finished after ") and " of training (step 20); epoch 0: loss " in summary
    assert summary.endswith(f"; run directory {run_dir}") and " eval_loss " in summary
    records = lines(run_dir)
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [5, 10, 15, 20]
    lrs = [r["lr"] for r in steps]
    assert lrs[0] == pytest.approx(0.002) and lrs == sorted(lrs, reverse=True)  # warmed up by step 5, then cosine
    final = records[-1]
    assert final["kind"] == "epoch" and final["step"] == 20
    code, unigram, err = ranks.run([sys.executable, "text.py"], timeout=60, cwd=example)
    assert code == 0, err[-3000:]
    baseline = float(unigram.split()[2])  # "unigram baseline: 3.1328 nats/char ..."
    assert baseline == pytest.approx(3.13, abs=0.01)
    assert final["eval_loss"] < baseline  # validation loss: the model uses context after 20 steps (2.81)


@pytest.mark.slow
def test_resnet_images_smoke(ranks, tmp_path):
    pytest.importorskip("PIL", reason="the image example reads its folder with Pillow (pip install pillow)")
    example = copy_example("resnet_images", tmp_path)
    images = tmp_path / "shapes"
    code, _, err = ranks.run([sys.executable, "make_shapes.py", str(images), "--per-class", "64"], timeout=60,
                             cwd=example)
    assert code == 0, err[-3000:]
    assert sorted(os.listdir(images)) == ["circle", "cross", "square", "triangle"]
    run_dir = tmp_path / "run"
    rc, out, err = ranks.cli(["train", "config.yaml", f"data.args.root={images}", f"run_dir={run_dir}",
                            "logging.progress=false", "trainer.epochs=5", "trainer.batch_size=16",
                            "scheduler.args={T_max: 35}"],
                           cwd=example, timeout=120)
    assert rc == 0, err[-3000:]
    epochs = [r for r in lines(run_dir) if r["kind"] == "epoch"]
    assert [e["step"] for e in epochs] == [7 * (i + 1) for i in range(5)]  # 204 training images / 32 per step
    assert epochs[-1]["loss"] < epochs[0]["loss"] / 3
    assert epochs[-1]["accuracy"] > 0.8  # 4 classes: chance is 0.25

    # Without data.args.root the example's own function refuses in one line (how a worker's
    # DdpxError reaches the command line, test_user_errors.py checks end to end).
    spec = importlib.util.spec_from_file_location("example_images", example / "images.py")
    images = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(images)
    with pytest.raises(DdpxError, match=r"data.args.root None is not a folder; point it at root/<class>/<image>"):
        images.image_folder(**yaml.safe_load((example / "config.yaml").read_text())["data"]["args"])

"""``logging.tensorboard: true`` writes rank 0's scalars to run_dir/tensorboard, the
same numbers as metrics.jsonl, plus the AMP scale and the comm hook's compression."""

import json
import sys

import pytest

from ddpx.config import load_config
from ddpx.errors import DdpxError


@pytest.mark.slow
def test_tensorboard_scalars_match_the_metrics_file(ranks, tmp_path):
    pytest.importorskip("tensorboard", reason="pip install 'ddpx[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    rc, out, err = ranks.cli(["train", "trainer.epochs=2", f"run_dir={run_dir}", "logging.tensorboard=true",
                            "logging.every_steps=10", "logging.progress=false", "amp.enabled=true",
                            "comm_hook.name=int8", "checkpoint.enabled=false"], cwd=tmp_path, timeout=120)
    assert rc == 0, err[-3000:]
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    epochs = [r for r in records if r["kind"] == "epoch"]
    for key in ("loss", "lr", "samples_per_s"):
        assert scalars[f"train/{key}"] == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in steps]
    for key in ("loss", "eval_loss", "accuracy", "amp_scale", "amp_skipped_steps"):
        assert scalars[f"epoch/{key}"] == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in epochs]
    assert [s for s, _ in scalars["train/amp_scale"]] == [r["step"] for r in steps]
    # int8 blockwise on 2 ranks: about 4x less than fp32 (one fp32 scale per block on top)
    assert all(3.0 < v < 4.0 for _, v in scalars["comm/compression"])
    # digits MLP: 26,122 parameters; a ring allreduce on 2 ranks sends about the buffer's size per step
    assert all(26122 < v < 26122 * 4 / 3 for _, v in scalars["comm/wire_bytes_per_step"])


def test_missing_tensorboard_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(DdpxError, match=r"logging.tensorboard needs the tensorboard package: pip install 'ddpx\[tensorboard\]'"):
        load_config(None, ["logging.tensorboard=true"])

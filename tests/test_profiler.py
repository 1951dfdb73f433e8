"""The profiler plugin: traces in run_dir/profile that load as JSON (Chrome/Perfetto and
TensorBoard read this format) with the comm hook's phases as named ranges, in the Python
and the native hook; a summary table on rank 0."""

import glob
import json

import pytest

from ddpx.config import load_config
from ddpx.errors import DdpxError
from ddpx.train.trainer import Trainer

PHASES = ("ddpx::encode", "ddpx::collective", "ddpx::decode")


def traces(run_dir, rank):
    files = glob.glob(str(run_dir / "profile" / f"rank{rank}.*.pt.trace.json"))
    assert len(files) == 1, files
    with open(files[0]) as f:
        return json.load(f)


def range_names(trace):
    return {event.get("name") for event in trace["traceEvents"]}


def test_a_profiled_run_writes_a_trace_and_a_summary(make_config, tmp_path):
    trainer = Trainer(make_config("trainer.eval_every_epochs=0", "trainer.epochs=1", "trainer.max_steps=8",
                                  "profile.enabled=true", "profile.wait=1", "profile.warmup=1", "profile.active=2"))
    trainer.run()
    names = range_names(traces(tmp_path / "run", 0))
    # The schedule: steps 1 waits, 2 warms up, 3 and 4 are recorded (numbered from 0 by torch).
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#4" not in names
    assert "aten::addmm" in names  # the model's forward
    summary = (tmp_path / "run" / "profile" / "summary_rank0.txt").read_text()
    assert "Self CPU" in summary and "aten::" in summary
    assert trainer.plugin("profiler").run.running is False  # stopped after its last active step, not at the end


def test_bad_profile_settings_are_one_line_errors():
    with pytest.raises(DdpxError, match=r"profile.active must be >= 1"):
        load_config(None, ["profile.enabled=true", "profile.active=0"])
    with pytest.raises(DdpxError, match=r"profile.ranks must be a list of rank numbers"):
        load_config(None, ["profile.enabled=true", "profile.ranks=[-1]"])


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("native", [False, True])
def test_the_comm_hook_phases_are_named_ranges_in_the_trace(ranks, tmp_path, native):
    run_dir = tmp_path / "run"
    rc, out, err = ranks.cli(["train", "--nproc-per-node=2", f"run_dir={run_dir}", "logging.progress=false",
                              "trainer.epochs=1", "trainer.max_steps=6", "trainer.eval_every_epochs=0",
                              "comm_hook.name=int8", f"comm_hook.native={str(native).lower()}",
                              "profile.enabled=true", "profile.ranks=[0, 1]"], cwd=tmp_path, timeout=200)
    assert rc == 0, err[-3000:]
    assert f"({'native C++' if native else 'Python'} hook" in err  # the path the ranges come from
    for rank in (0, 1):
        names = range_names(traces(run_dir, rank))
        assert set(PHASES) <= names, sorted(n for n in names if n and n.startswith("ddpx"))
    assert err.count("top operators by self time") == 1  # rank 0's table, once
    assert (run_dir / "profile" / "summary_rank1.txt").exists()

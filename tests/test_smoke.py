"""``ddpx train --smoke``: passes on the default example, names a failing plugin."""

import os
import textwrap
from pathlib import Path

import pytest

from ddpx.smoke import rank as smoke_rank, report as smoke_report

pytestmark = pytest.mark.timeout(240)


def _table(out):
    rows = {}
    for line in out.splitlines():
        for stage in smoke_rank.STAGES:
            if line.startswith(stage + " ") and line[len(stage):].split()[0] in (smoke_rank.PASS, smoke_rank.FAIL, smoke_rank.SKIP):
                rows[stage] = line[len(stage):].split(None, 1)
    return rows


def documented_output():
    """The lines docs/cluster.md shows ``ddpx train --smoke`` printing."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "cluster.md").read_text()
    block = text.split("    $ ddpx train --smoke\n", 1)[1].split("\n\n", 1)[0]
    return [line[4:] for line in block.splitlines()]


def test_smoke_passes_on_the_default_example(ranks, tmp_path):
    rc, out, err = ranks.cli(["train", "--smoke"], timeout=120, cwd=tmp_path)
    assert rc == 0, out + err
    # what docs/cluster.md shows, and nothing else: no training lines, bar or summaries before the table
    assert [line.split()[0] for line in out.splitlines()] == [line.split()[0] for line in documented_output()], out
    assert not [line for line in err.splitlines() if line.startswith("[rank") or "%|" in line], err
    rows = _table(out)
    assert set(rows) == set(smoke_rank.STAGES), out
    assert all(status == smoke_rank.PASS for status, _ in rows.values()), out
    assert "smoke run PASSED" in out
    assert "2 rank(s)" in out  # the default example's processes
    assert "weights identical" in rows["resume"][1]
    assert "3 optimizer steps" in rows["train"][1] and "2 optimizer steps" in rows["train after resume"][1]
    # it ran on the slice, in a run dir of its own
    assert list(tmp_path.glob("runs/smoke-*/checkpoints/*.pt"))


def test_the_smoke_run_dir_is_under_the_run_dir_or_runs(tmp_path, monkeypatch):
    from ddpx.config import load_config

    monkeypatch.chdir(tmp_path)
    mine = smoke_report.smoke_run_dir(load_config(None, ["run_dir=mine"]), env={})
    assert os.path.dirname(mine) == str(tmp_path / "mine") and os.path.basename(mine).startswith("smoke-20")
    assert smoke_report.smoke_run_dir(load_config(None, []), env={"SLURM_JOB_ID": "42"}) == str(tmp_path / "runs" / "smoke-42")


BROKEN_PLUGIN = textwrap.dedent(
    """
    from ddpx import hookimpl

    @hookimpl
    def ddpx_epoch_start(trainer, epoch):
        raise RuntimeError("broken on purpose")
    """
)


def test_smoke_names_the_failing_plugin(ranks, tmp_path):
    (tmp_path / "broken_smoke_plugin.py").write_text(BROKEN_PLUGIN)
    rc, out, err = ranks.cli(["train", "--smoke", "plugins.enable=[broken_smoke_plugin]"], timeout=120,
                           cwd=tmp_path, env={"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])})
    assert rc == 1, out + err
    rows = _table(out)
    assert rows["config"][0] == rows["setup"][0] == smoke_rank.PASS, out
    assert rows["train"][0] == smoke_rank.FAIL
    assert "plugin 'broken_smoke_plugin' raised in ddpx_epoch_start: RuntimeError: broken on purpose" in rows["train"][1]
    assert all(rows[s][0] == smoke_rank.SKIP for s in smoke_rank.STAGES[smoke_rank.STAGES.index("train") + 1:]), out
    assert "smoke run FAILED at train: plugin 'broken_smoke_plugin' (ddpx_epoch_start)" in out


def test_smoke_names_a_plugin_failing_while_reading_the_config(ranks, tmp_path):
    (tmp_path / "configure_fails.py").write_text(
        "from ddpx import hookimpl\n\n@hookimpl\ndef ddpx_configure(config):\n    raise ValueError('no')\n")
    rc, out, err = ranks.cli(["train", "--smoke", "plugins.enable=[configure_fails]"], timeout=60,
                           cwd=tmp_path, env={"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])})
    assert rc == 2  # nothing was launched: a one-line error
    assert "plugin 'configure_fails' raised in ddpx_configure: ValueError: no" in err
    assert "Traceback" not in err


def test_summary_marks_a_missing_rank_and_a_failure():
    ok = {"stage": "config", "status": "PASS", "detail": "", "seconds": 0.1}
    bad = {"stage": "setup", "status": "FAIL", "detail": "plugin 'p' raised in ddpx_setup: E: x",
           "seconds": 0.2, "plugin": "p", "hook": "ddpx_setup"}
    results = [{"rank": 0, "world_size": 3, "stages": [ok, bad]}, {"rank": 1, "world_size": 3, "stages": [ok]}]
    rows = {r["stage"]: r for r in smoke_report.summarize(results, 3)}
    assert rows["config"]["status"] == "FAIL" and "rank 2" in rows["config"]["detail"]
    assert rows["setup"]["status"] == "FAIL" and rows["setup"]["plugin"] == "p"
    text = smoke_report.format_table(smoke_report.summarize(results, 3), 3, "/x")
    assert "FAILED at config" in text

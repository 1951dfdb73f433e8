"""One run per run_dir: a lock naming its holder; stale locks taken over (issue 28, finding 5)."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

import harness
from ddpx.errors import DdpxError
from ddpx.rank.run_lock import LOCK_NAME, RunLock, read_holder
from ddpx.train.trainer import Trainer


def test_a_second_holder_is_refused_in_one_line_naming_the_first(tmp_path):
    first = RunLock(tmp_path)
    first.acquire()
    holder = read_holder(tmp_path)
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    second = RunLock(tmp_path)
    second.me = {**second.me, "job": "another"}  # another launch
    with pytest.raises(DdpxError) as info:
        second.acquire()
    message = str(info.value)
    assert "\n" not in message and "is in use by another run" in message and f"pid {os.getpid()}" in message
    first.release()
    assert not (tmp_path / LOCK_NAME).exists()
    second.acquire()  # free now
    second.release()


def test_a_dead_pid_on_this_host_is_taken_over_with_a_warning(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "job": "old",
                                                  "started": time.time()}))
    lock = RunLock(tmp_path)
    with caplog.at_level("WARNING", logger="ddpx"):
        lock.acquire()
    assert "taking over the stale lock" in caplog.text and f"pid {dead.pid} is not running" in caplog.text
    assert read_holder(tmp_path)["pid"] == os.getpid()
    lock.release()


def test_another_hosts_lock_is_stale_only_after_the_lease(tmp_path, monkeypatch):
    path = tmp_path / LOCK_NAME
    path.write_text(json.dumps({"host": "elsewhere", "pid": 1, "job": "theirs", "started": time.time()}))
    with pytest.raises(DdpxError, match="pid 1 on elsewhere"):
        RunLock(tmp_path).acquire()
    monkeypatch.setenv("DDPX_LOCK_LEASE_S", "60")
    old = time.time() - 120
    os.utime(path, (old, old))
    lock = RunLock(tmp_path)
    lock.acquire()  # not refreshed for 120 s > 60 s lease
    assert read_holder(tmp_path)["host"] == socket.gethostname()
    lock.release()


def test_the_same_job_takes_its_lock_over_silently_even_from_another_host(tmp_path, monkeypatch, caplog):
    """An elastic re-formation may put rank 0 on another node: same job, no refusal, no warning."""
    monkeypatch.setenv("DDPX_JOB_ID", "ddpx@10.0.0.1:29400")
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": "node1", "pid": 1, "job": "ddpx@10.0.0.1:29400",
                                                  "started": time.time()}))
    lock = RunLock(tmp_path)
    with caplog.at_level("WARNING", logger="ddpx"):
        lock.acquire()
    assert read_holder(tmp_path)["pid"] == os.getpid() and "taking over" not in caplog.text
    lock.release()


def test_a_trainer_holds_the_lock_while_it_runs(make_config, tmp_path):
    config = make_config("trainer.epochs=1", "trainer.max_steps=2", "trainer.eval_every_epochs=0")
    trainer = Trainer(config)
    with trainer:
        trainer.setup()
        assert read_holder(tmp_path / "run")["pid"] == os.getpid()
        blocked = RunLock(tmp_path / "run")
        blocked.me = {**blocked.me, "job": "another"}
        with pytest.raises(DdpxError, match="is in use by another run"):
            blocked.acquire()
    assert read_holder(tmp_path / "run") is None  # released by close()


@pytest.mark.slow
def test_two_concurrent_runs_on_one_run_dir(ranks, tmp_path):
    """The second `ddpx train` on the same run_dir refuses in one line; the first finishes untouched."""
    run_dir = tmp_path / "run"
    config = tmp_path / "c.yaml"
    config.write_text(f"run_dir: {run_dir}\ntrainer: {{epochs: 3}}\nlogging: {{progress: false}}\n"
                      "launch: {nproc_per_node: 1}\nplugins: {enable: [gate]}\n")
    # the first run waits after its first epoch until the second has been refused: on a busy
    # machine its 3 epochs would otherwise end before the second starts
    (tmp_path / "gate.py").write_text(textwrap.dedent(f"""
        import os, time
        from ddpx import hookimpl

        @hookimpl
        def ddpx_epoch_end(trainer, epoch, metrics):
            deadline = time.monotonic() + 300
            while epoch == 0 and not os.path.exists({str(tmp_path / "go")!r}) and time.monotonic() < deadline:
                time.sleep(0.1)
    """))
    log = tmp_path / "first.log"
    first = harness.start([sys.executable, "-m", "ddpx", "train", str(config)], log, harness.base_env(), cwd=tmp_path)
    try:
        assert harness.wait_for(lambda: read_holder(run_dir) is not None or first.poll() is not None, 120, poll=0.1), \
            "the first run never took the lock"
        assert first.poll() is None, log.read_text()
        code, out, err = ranks.cli(["train", str(config)], timeout=120, cwd=tmp_path)
        assert code == 2 and "is in use by another run" in err and "Traceback" not in err, err
        assert f"pid {read_holder(run_dir)['pid']}" in err
        (tmp_path / "go").touch()
    except BaseException:
        harness.finish([first], [log], timeout=0)
        raise
    (ended,) = harness.finish([first], [log], timeout=300)
    assert ended.returncode == 0, ended.output[-3000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines if '"epoch"' in line][-1] == 2
    assert read_holder(run_dir) is None

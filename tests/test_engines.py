"""The engines users already run (docs/engines.md): ``ddpx.fit`` in a process group that a
launcher created (Ray Train's ``TorchTrainer``; here the test's own ``init_process_group``, which
is what Ray does in each worker), and ``ddpx train`` configured by a Kubeflow TrainJob's
``PET_*`` variables. A run under Ray itself takes longer than the suite allows:
benchmarks/bench_engines.py runs it."""

import datetime
import json
import os
import pickle
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ddpx
from ddpx.errors import DdpxError
from ddpx.net import free_port
from ddpx.rank import process_group

TINY = ["trainer.epochs=1", "trainer.max_steps=6", "model.args.hidden=16", "logging.progress=false"]


def _epochs(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("kind") == "epoch"]


def test_fit_trains_in_the_callers_group_and_leaves_it_as_found(tmp_path):
    alone = ddpx.fit(None, [*TINY, f"run_dir={tmp_path / 'alone'}"])  # ddpx makes its group of one, and ends it
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=77))
    try:
        group = dist.distributed_c10d._get_default_group()
        config = {"trainer": {"epochs": 1, "max_steps": 6}, "model": {"args": {"hidden": 16}}}  # a dict as the YAML
        inside = ddpx.fit(config, ["logging.progress=false", f"run_dir={tmp_path / 'inside'}"])
        assert inside == alone and len(inside) == 1 and inside[0]["step"] == 6
        assert dist.distributed_c10d._get_default_group() is group  # not destroyed, not replaced
        assert process_group.group_timeout(group) == datetime.timedelta(seconds=77)  # trainer.timeout_s given back
        with pytest.raises(DdpxError, match=r"^trainer.backend=nccl, but this process already has a process group "
                                            r"that uses gloo; use trainer.backend=auto, or create that group with nccl$"
                           ) as raised:
            ddpx.fit(None, [*TINY, "trainer.backend=nccl", f"run_dir={tmp_path / 'nccl'}"])
        assert str(pickle.loads(pickle.dumps(raised.value))) == str(raised.value)  # Ray sends it to the driver so
        assert dist.distributed_c10d._get_default_group() is group
    finally:
        dist.destroy_process_group()


def test_the_run_lock_tells_two_jobs_in_groups_of_their_launchers_apart(tmp_path):
    """Under Ray every job's workers are children of the node's raylet, so the lock's job (the
    host and parent pid) was the same for two Ray jobs, and the second took the first's run_dir
    over without a word. In a launcher's group the job is the group's store."""
    import socket

    from ddpx.rank.run_lock import LOCK_NAME, read_holder

    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        assert process_group.adopted_group_id() is None  # not adopted yet: a group of the caller's own
        run_dir = tmp_path / "shared"
        run_dir.mkdir()
        for other_job in (f"{socket.gethostname()}:{os.getppid()}", "store@127.0.0.1:1"):  # before, after the fix
            (run_dir / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(),
                                                         "job": other_job, "started": 0}))  # a live process
            with pytest.raises(DdpxError, match=f"^run_dir {run_dir} is in use by another run \\(pid {os.getppid()} "):
                ddpx.fit(None, [*TINY, f"run_dir={run_dir}"])
        assert read_holder(run_dir)["job"] == "store@127.0.0.1:1"  # left to its holder
        assert process_group.adopted_group_id() == f"store@127.0.0.1:{port}"  # the job of the runs refused
    finally:
        dist.destroy_process_group()


def _fit_in_the_callers_group_then_in_its_own(rank, world, run_dirs, ports):
    """One rank: the group exists (harness.call_ranks made it, as Ray Train does in each worker),
    with no RANK/WORLD_SIZE in the environment; then, that group gone, torchrun's variables; then
    a group of the caller's again, where rank 1 fails."""
    group = dist.distributed_c10d._get_default_group()
    in_callers = ddpx.fit(None, [*TINY, f"run_dir={run_dirs[0]}"])
    kept = dist.distributed_c10d._get_default_group() is group
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)  # the caller's group still pairs its collectives
    dist.destroy_process_group()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]))
    in_its_own = ddpx.fit(None, [*TINY, f"run_dir={run_dirs[1]}"])  # rank 0 serves the store, as under srun
    initialized = dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank, world_size=world)
    try:  # rank 1 fails, then its process ends (as Ray ends a failed worker group): rank 0 is stopped
        ddpx.fit(None, [*TINY, "trainer.max_steps=20", "trainer.timeout_s=60", f"run_dir={run_dirs[2]}",
                        "plugins.enable=[sample_plugins.RaisesOnRank1AtStep3]"])
        raised = None
    except RuntimeError as exc:
        raised = [str(exc), *getattr(exc, "__notes__", [])]
    return in_callers, in_its_own, kept, total.item(), initialized, raised


@pytest.mark.slow
def test_two_ranks_train_in_the_callers_group_as_in_a_group_of_their_own(ranks, tmp_path):
    run_dirs = [tmp_path / "callers", tmp_path / "own", tmp_path / "failing"]
    results = ranks.call(_fit_in_the_callers_group_then_in_its_own, 2, (run_dirs, [free_port(), free_port()]),
                         timeout=150)
    for in_callers, in_its_own, kept, total, initialized, _ in results:
        assert in_callers == in_its_own and in_callers[-1]["step"] == 6
        assert kept and total == 3.0 and not initialized
    assert results[0][0] == results[1][0]
    for run_dir in run_dirs[:2]:  # one run directory for both ranks: rank 0's
        assert _epochs(run_dir) == [{"kind": "epoch", **results[0][0][0]}]
        assert [p.name for p in (run_dir / "checkpoints").glob("step-*.pt")] == ["step-000000006.pt"]
    assert results[1][5] == ["broken on purpose on rank 1",
                             "(raised by plugin 'sample_plugins.RaisesOnRank1AtStep3' in ddpx_batch_end)"]
    assert results[0][5][-1] == "ddpx: stopped at step 3: rank 1 failed first: RuntimeError: broken on purpose on rank 1"
@pytest.mark.slow
def test_ddpx_train_configured_by_a_kubeflow_trainjobs_pet_variables(ranks, tmp_path):
    """Two pods of a TrainJob, here two `ddpx train` on this machine with no launch flags: each
    has PET_NNODES, PET_NPROC_PER_NODE, PET_MASTER_ADDR, PET_MASTER_PORT and its PET_NODE_RANK."""
    pet = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_MASTER_ADDR": "127.0.0.1",
           "PET_MASTER_PORT": str(free_port())}
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "ddpx", "train", "trainer.epochs=1", "model.args.hidden=16",
               f"run_dir={run_dir}", "logging.progress=false"]
    nodes = ranks.commands([command, command], tmp_path, timeout=150, cwd=tmp_path, names=["node0", "node1"],
                           env=[{**pet, "PET_NODE_RANK": str(node)} for node in range(2)])
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(
        f"--- node{i} (exit {node.returncode}) ---\n{node.output[-3000:]}" for i, node in enumerate(nodes))
    # World size 2 (2 nodes x 1 process): 23 steps in the epoch (1438 samples / (2 x 32)); 45 on one rank.
    assert [(e["epoch"], e["step"]) for e in _epochs(run_dir)] == [(0, 23)]
    # Rank 0 (it alone prints) is node 0's process: node 1 did not start a run of its own.
    assert "[rank0] finished after" in nodes[0].output and "[rank" not in nodes[1].output, nodes[1].output

"""SLURM environment -> torchrun arguments (faked SLURM environments)."""

import os

import pytest

from ddpx.errors import DdpxError
from ddpx.launch.slurm import expand_nodelist, in_slurm_step, launch_from_slurm


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-04,07],gpu-a", ["node01", "node02", "node03", "node04", "node07", "gpu-a"]),
        ("gpu-a,node[9-11]", ["gpu-a", "node9", "node10", "node11"]),
        ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
        ("a[3],b[001-002]", ["a3", "b001", "b002"]),
    ],
)
def test_expand_nodelist_like_scontrol(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-04", "node]1[", "node[04-01]", "node[a-b]"])
def test_bad_nodelist_is_a_user_error(bad):
    with pytest.raises(DdpxError, match="node list"):
        expand_nodelist(bad)


def _job(**extra):
    env = {
        "SLURM_JOB_ID": "123456",
        "SLURM_NNODES": "4",
        "SLURM_NODEID": "2",
        "SLURM_PROCID": "2",
        "SLURM_NTASKS": "4",
        "SLURM_JOB_NODELIST": "gpu[07-09],gpu12",
        "SLURM_GPUS_ON_NODE": "8",
    }
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def test_faked_job_maps_to_the_launch_settings():
    launch = launch_from_slurm(_job())
    assert (launch.nnodes, launch.node_rank, launch.rdzv_endpoint, launch.rdzv_id, launch.nproc_per_node) == \
        (4, 2, "gpu07:23456", "123456", 8)


def test_explicit_master_port_and_job_num_nodes_and_procid_fallback():
    env = _job(SLURM_NNODES=None, SLURM_JOB_NUM_NODES="4", SLURM_NODEID=None,
               SLURM_PROCID="3", MASTER_PORT="29999", SLURM_GPUS_ON_NODE=None)
    launch = launch_from_slurm(env)
    assert (launch.nnodes, launch.node_rank, launch.rdzv_endpoint) == (4, 3, "gpu07:29999")
    assert launch.nproc_per_node is None  # CPU job: the launcher's "auto" decides


def test_cpu_job_takes_nproc_from_ntasks_per_node_of_the_allocation():
    env = _job(SLURM_GPUS_ON_NODE=None, SLURM_NTASKS_PER_NODE="4", SLURM_NTASKS=None)
    assert launch_from_slurm(env).nproc_per_node == 4


def test_one_task_per_node_is_enforced():
    with pytest.raises(DdpxError, match="--ntasks-per-node=1"):
        launch_from_slurm(_job(SLURM_NTASKS="32"))


def test_detection_of_an_srun_step():
    assert in_slurm_step(_job())
    assert not in_slurm_step({})
    assert not in_slurm_step(_job(DDPX_SLURM="0"))
    # inside torchrun's workers the launcher already ran
    assert not in_slurm_step(_job(TORCHELASTIC_RUN_ID="123456"))


def test_launcher_uses_the_slurm_settings(monkeypatch):
    from ddpx.config import load_config
    from ddpx.launch.options import LaunchOptions
    from ddpx.launch.torchrun import torchrun_argv
    from ddpx.net import free_port

    port = free_port()
    env = _job(SLURM_NNODES="2", SLURM_NODEID="0", SLURM_NTASKS="2", SLURM_JOB_NODELIST="localhost,node2",
               SLURM_GPUS_ON_NODE="3", MASTER_PORT=str(port))
    for key in [k for k in list(os.environ) if k.startswith("SLURM_") or k == "TORCHELASTIC_RUN_ID"]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config = load_config(None, [])
    argv = torchrun_argv(LaunchOptions(), config.launch, None, [])
    for expected in ("--nnodes=2", "--node-rank=0", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint=localhost:{port}", "--rdzv-id=123456", "--nproc-per-node=3"):
        assert expected in argv, (expected, argv)
    # an explicit option still wins over SLURM
    argv = torchrun_argv(LaunchOptions(nproc_per_node="1"), config.launch, None, [])
    assert "--nproc-per-node=1" in argv and "--nproc-per-node=3" not in argv

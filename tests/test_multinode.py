"""Torchrun agents ("nodes") meet through c10d rendezvous: two on this machine, and
the README's command on two network-namespace hosts whose hostname resolves to loopback."""

import json
import os
import sys

import harness
import pytest

from ddpx.net import free_port


@pytest.mark.slow
def test_two_nodes_through_c10d_rendezvous(ranks, tmp_path):
    port = free_port()
    run_dir = tmp_path / "run"
    common = [
        sys.executable, "-m", "ddpx", "train", "trainer.epochs=2", f"run_dir={run_dir}", "logging.progress=false",
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
    ]
    nodes = ranks.commands([common, common], tmp_path, timeout=150, cwd=tmp_path, names=["node0", "node1"])
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(
        f"--- node{i} (exit {node.returncode}) ---\n{node.output[-3000:]}" for i, node in enumerate(nodes))
    epochs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    epochs = [e for e in epochs if e.get("kind") == "epoch"]
    # World size 2 across the two agents: 23 steps per epoch (1438 samples / (2 x 32)).
    assert [(e["epoch"], e["step"]) for e in epochs] == [(0, 23), (1, 46)]
    assert epochs[-1]["accuracy"] > 0.5


def _epochs(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(e["epoch"], e["step"], e["loss"], e["accuracy"]) for e in map(json.loads, lines) if e.get("kind") == "epoch"]


@pytest.fixture(scope="module")
def one_host_reference(ranks, tmp_path_factory):
    """Epoch records of the same run on one host with the same world size (2) and seed."""
    tmp = tmp_path_factory.mktemp("one-host")
    code, out, err = ranks.cli(["train", "--nproc-per-node", "2", "trainer.epochs=3", f"run_dir={tmp / 'run'}",
                              "logging.progress=false"], timeout=150, cwd=tmp)
    assert code == 0, err[-3000:]
    return _epochs(tmp / "run")


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.timeout(300)
@pytest.mark.skipif(not harness.netns_available(), reason="needs root and ip netns")
@pytest.mark.parametrize("ifname", ["unset", "set"])
def test_readme_command_on_two_hosts_through_c10d(ranks, tmp_path, two_hosts, one_host_reference, ifname):
    """`ddpx train --nnodes 2 --nproc-per-node 1 --rdzv-endpoint HOST0:PORT` on each host: node 0
    hosts the store although its hostname resolves to 127.0.0.1, the workers' MASTER_ADDR is
    reachable, and the result equals the one-host run's."""
    endpoint = f"{two_hosts[0][2]}:{free_port()}"
    cmds, envs = [], []
    for ns, iface, addr in two_hosts:
        env = {"GLOO_SOCKET_IFNAME": None, "NCCL_SOCKET_IFNAME": None}
        if ifname == "set":
            env["GLOO_SOCKET_IFNAME"] = iface
        cmds.append(["ip", "netns", "exec", ns, sys.executable, "-m", "ddpx", "train", "--nnodes", "2",
                     "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "trainer.epochs=3",
                     f"run_dir={tmp_path / 'run'}", "logging.progress=false"])
        envs.append(env)
    nodes = ranks.commands(cmds, tmp_path, timeout=150, env=envs, cwd=tmp_path, names=[a for _, _, a in two_hosts])
    logs = {addr: node.output for (_, _, addr), node in zip(two_hosts, nodes)}
    assert [node.returncode for node in nodes] == [0, 0], logs
    for ns, iface, addr in two_hosts:
        chosen = f"NCCL_SOCKET_IFNAME={iface}" if ifname == "set" else f"GLOO_SOCKET_IFNAME={iface} NCCL_SOCKET_IFNAME={iface}"
        assert f"ddpx: node {addr}: {chosen} (the interface that reaches {two_hosts[0][2]};" in logs[addr], logs[addr]
        assert "frame #" not in logs[addr]  # no C++ stack trace
    assert _epochs(tmp_path / "run") == one_host_reference


def _fake_agent(markers):
    """A torchrun `run` whose local workers wrote `markers` done-files, then lost the c10d store."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from ddpx.launch import torchrun

    def run(args):
        for rank in range(markers):
            open(os.path.join(os.environ[torchrun.DONE_DIR_ENV], f"rank-{rank}"), "w").close()
        raise RendezvousConnectionError("The connection to the C10d store has failed.")

    return run


def test_store_lost_after_every_local_worker_finished_is_only_a_warning(monkeypatch, capsys):
    import torch.distributed.run

    from ddpx.launch import torchrun

    monkeypatch.setattr(torch.distributed.run, "run", _fake_agent(markers=2))
    argv = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1",
            "-m", "ddpx.worker"]
    assert torchrun.run_torchrun(argv) == 0
    assert "training finished; torchrun's rendezvous shutdown failed" in capsys.readouterr().err
    assert torchrun.DONE_DIR_ENV not in os.environ


def test_store_lost_before_every_local_worker_finished_is_an_error(monkeypatch):
    import torch.distributed.run

    from ddpx.launch import torchrun
    from ddpx.errors import DdpxError

    monkeypatch.setattr(torch.distributed.run, "run", _fake_agent(markers=1))
    argv = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1",
            "-m", "ddpx.worker"]
    with pytest.raises(DdpxError, match=r"^node \S+: lost the rendezvous store at 127.0.0.1:1 \(hosted by the node "
                                         r"that owns 127.0.0.1\): that node stopped or is unreachable from here"):
        torchrun.run_torchrun(argv)


def _agent_with_a_rank_aborting(markers):
    """A torchrun `run` whose local workers wrote `markers` done-files, then rank 1 died of SIGABRT."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from ddpx.launch import torchrun

    def run(args):
        for rank in range(markers):
            open(os.path.join(os.environ[torchrun.DONE_DIR_ENV], f"rank-{rank}"), "w").close()
        raise ChildFailedError("ddpx.worker", {1: ProcessFailure(local_rank=1, pid=4242, exitcode=-6, error_file="")})

    return run


def test_a_rank_dying_at_exit_after_every_local_worker_finished_is_only_a_warning(monkeypatch, capsys):
    import torch.distributed.run

    from ddpx.launch import torchrun

    monkeypatch.setattr(torch.distributed.run, "run", _agent_with_a_rank_aborting(markers=2))
    assert torchrun.run_torchrun(["--nproc-per-node", "2", "--standalone", "-m", "ddpx.worker"]) == 0
    assert "ddpx: warning: training finished; rank 1 then was killed by signal 6 while exiting" in capsys.readouterr().err


def test_a_rank_dying_before_every_local_worker_finished_is_an_error(monkeypatch):
    import torch.distributed.run

    from ddpx.launch import torchrun
    from ddpx.errors import DdpxError

    monkeypatch.setattr(torch.distributed.run, "run", _agent_with_a_rank_aborting(markers=1))
    with pytest.raises(DdpxError, match=r"training failed: rank 1 \(pid 4242\) was killed by signal 6$"):
        torchrun.run_torchrun(["--nproc-per-node", "2", "--standalone", "-m", "ddpx.worker"])

"""The launcher's multi-node decisions without starting anything: who hosts the c10d store,
--local-addr, the interface variables, torchrun's PET_* variables, and the workers' choice."""

import os
import socket
import time

import pytest

import harness
from ddpx import net
from ddpx.launch import rendezvous, torchrun
from ddpx.rank import process_group
from ddpx.config import load_config
from ddpx.errors import DdpxError
from ddpx.launch.options import LaunchOptions
from ddpx.launch.torchrun import torchrun_argv


@pytest.fixture
def clean_env(monkeypatch):
    """No interface, PET_* or SLURM variables; the launcher sets some in os.environ: all undone after."""
    saved = dict(os.environ)
    for name in [n for n in os.environ if n.startswith(("PET_", "SLURM_"))] + [
            "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]:
        os.environ.pop(name, None)
    yield monkeypatch
    os.environ.clear()
    os.environ.update(saved)


def _pretend(monkeypatch, **route):
    """route_to answers ``route`` (the machine's real interfaces and names do not matter here)."""
    monkeypatch.setattr(net, "resolve", lambda host: ([route["address"]], ""))
    monkeypatch.setattr(net, "route_to", lambda host, port: net.Route(host, port, **route))
    monkeypatch.setattr(rendezvous, "check_rendezvous", lambda r, wait_s: None if r.one_machine else r.local)


def _argv(opts):
    return torchrun_argv(opts, load_config(None, []).launch, None, [])


def test_the_node_owning_the_endpoint_hosts_the_store_and_advertises_its_interface_address(clean_env, capsys):
    _pretend(clean_env, address="10.9.0.1", local=True, local_addr="10.9.0.1", iface="eth7")
    argv = _argv(LaunchOptions(nnodes="2", nproc_per_node="1", rdzv_endpoint="node0:29400"))
    assert "--rdzv-conf=is_host=true" in argv and "--local-addr=10.9.0.1" in argv
    assert "--rdzv-backend=c10d" in argv and "--rdzv-endpoint=node0:29400" in argv
    assert capsys.readouterr().err == (
        "ddpx: node 10.9.0.1: GLOO_SOCKET_IFNAME=eth7 NCCL_SOCKET_IFNAME=eth7 (the interface that reaches node0; "
        "set these variables yourself to choose another)\n"
        "ddpx: node 10.9.0.1: joining the rendezvous at node0:29400 (--nnodes 2; waiting up to 600 s for the other "
        "nodes)\n")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"


def test_c10d_agents_leave_the_workers_store_to_each_groups_rank_0(clean_env):
    import torch.distributed.run

    seen = {}
    clean_env.setattr(torch.distributed.run, "run", lambda args: seen.update(os.environ))
    torchrun.run_torchrun(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1", "-m", "x"])
    assert seen[torchrun.SHARE_STORE_ENV] == "1" and torchrun.SHARE_STORE_ENV not in os.environ
    seen.clear()
    torchrun.run_torchrun(["--nproc-per-node", "2", "--standalone", "-m", "x"])  # one node: torchrun's agent store
    assert torchrun.SHARE_STORE_ENV not in seen


def test_another_node_joins_and_a_users_interface_wins(clean_env, capsys):
    clean_env.setenv("GLOO_SOCKET_IFNAME", "ib0")
    _pretend(clean_env, address="10.9.0.1", local=False, local_addr="10.9.0.2", iface="eth7")
    argv = _argv(LaunchOptions(nnodes="1:2", nproc_per_node="1", rdzv_endpoint="10.9.0.1:29400"))
    conf = next(a for a in argv if a.startswith("--rdzv-conf="))
    assert conf == ("--rdzv-conf=last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3,"
                    "is_host=false")
    assert "--local-addr=10.9.0.2" in argv
    assert "ddpx: node 10.9.0.2: NCCL_SOCKET_IFNAME=eth7 (" in capsys.readouterr().err
    assert os.environ["GLOO_SOCKET_IFNAME"] == "ib0"


def test_loopback_endpoint_leaves_the_host_choice_to_torchrun(clean_env):
    _pretend(clean_env, address="127.0.0.1", local=True, local_addr="127.0.0.1", iface="lo", one_machine=True)
    argv = _argv(LaunchOptions(nnodes="2", nproc_per_node="1", rdzv_endpoint="127.0.0.1:29400"))
    assert not any(a.startswith("--rdzv-conf") for a in argv)  # the first agent to bind serves


def test_an_agent_that_binds_the_endpoint_after_the_probe_is_joined(monkeypatch):
    """Two agents started at once on one machine: the other one binds the loopback endpoint
    between this one's probe and its bind test. This one joins it (a CI run once hung here:
    it failed "port busy" and the other agent waited for it until the join timeout)."""
    port = net.free_port()
    other_agent = socket.socket()
    real_probe = net.connect_probe

    def probe_then_the_other_agent_serves(addr, p, timeout=3.0):
        answer = real_probe(addr, p, timeout)
        if other_agent.fileno() != -1 and not other_agent.getsockname()[1]:
            other_agent.bind(("127.0.0.1", port))
            other_agent.listen()
        return answer

    monkeypatch.setattr(net, "connect_probe", probe_then_the_other_agent_serves)
    with other_agent:
        assert rendezvous.check_rendezvous(net.route_to("127.0.0.1", port), wait_s=1.0) is False


def test_a_busy_endpoint_that_never_listens_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(rendezvous, "BUSY_ENDPOINT_WAIT_S", 0.5)
    with socket.socket() as holder:  # bound, not listening: no agent will ever answer there
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        with pytest.raises(DdpxError, match=rf"^rendezvous port {port} on 127.0.0.1 is busy"):
            rendezvous.check_rendezvous(net.route_to("127.0.0.1", port), wait_s=1.0)


def test_a_master_name_that_does_not_resolve_yet_is_waited_for(clean_env, capsys):
    """Kubeflow: a worker pod may start before the first pod's name (PET_MASTER_ADDR) resolves."""
    asked = []

    def resolve(host):  # not yet, not yet, then the pod is up
        asked.append(host)
        return (["10.9.0.1"], "") if len(asked) > 2 else ([], "Name or service not known")

    _pretend(clean_env, address="10.9.0.1", local=False, local_addr="10.9.0.2", iface="eth0")
    clean_env.setattr(net, "resolve", resolve)
    clean_env.setattr(rendezvous, "RESOLVE_EVERY_S", 0.01)
    for name, value in {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-node-0-0.job",
                        "PET_MASTER_PORT": "29400"}.items():
        clean_env.setenv(name, value)
    assert "--rdzv-endpoint=job-node-0-0.job:29400" in _argv(LaunchOptions())
    assert asked == ["job-node-0-0.job"] * 3
    assert capsys.readouterr().err.splitlines()[0] == (
        f"ddpx: node {socket.gethostname()}: rendezvous host 'job-node-0-0.job' does not resolve yet (Name or service "
        "not known); waiting up to 60 s for it (node 0's name may appear only once node 0 runs)")


def test_a_rendezvous_host_that_never_resolves_is_one_line_after_the_wait(clean_env, capsys):
    clean_env.setattr(net, "resolve", lambda host: ([], "Name or service not known"))
    clean_env.setattr(rendezvous, "RESOLVE_EVERY_S", 0.05)
    clean_env.setenv("DDPX_RDZV_WAIT_S", "0.3")
    start, start_on_clock = time.monotonic(), harness.clock()
    with pytest.raises(DdpxError) as info:
        rendezvous.rendezvous_route(LaunchOptions(rdzv_endpoint="never.invalid:29400"), "2")
    # the wait (wall seconds, as the launcher counts them), not more (on the tests' clock)
    assert time.monotonic() - start >= 0.3 and harness.clock() - start_on_clock < 10
    assert str(info.value) == ("cannot resolve rendezvous host 'never.invalid' (Name or service not known) after "
                               "waiting 0.3 s; use node 0's IP address or a name every node resolves (wait longer "
                               "with DDPX_RDZV_WAIT_S=SECONDS)")
    assert "waiting up to 0.3 s for it" in capsys.readouterr().err
    with pytest.raises(DdpxError) as info:  # ddpx doctor's: it reports a name that does not resolve at once
        rendezvous.rendezvous_route(LaunchOptions(rdzv_endpoint="never.invalid:29400"), "2", wait_s=0)
    assert str(info.value) == ("cannot resolve rendezvous host 'never.invalid' (Name or service not known); use node "
                               "0's IP address or a name every node resolves")
    assert capsys.readouterr().err == ""
    clean_env.setenv("DDPX_RDZV_WAIT_S", "soon")
    with pytest.raises(DdpxError, match="^DDPX_RDZV_WAIT_S='soon' must be a number of seconds, 0 or more$"):
        rendezvous.rendezvous_route(LaunchOptions(rdzv_endpoint="never.invalid:29400"), "2")


def test_pet_variables_configure_the_launch_and_flags_win(clean_env, capsys):
    """A Kubeflow PyTorchJob without an elastic policy: PET_NNODES, PET_NODE_RANK and the master."""
    _pretend(clean_env, address="10.9.0.1", local=False, local_addr="10.9.0.2", iface="eth0")
    for name, value in {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-master-0",
                        "PET_MASTER_PORT": "23456", "PET_NPROC_PER_NODE": "3", "PET_RDZV_CONF": "join_timeout=900"}.items():
        clean_env.setenv(name, value)
    argv = _argv(LaunchOptions())
    for expected in ("--nnodes=2", "--node-rank=1", "--nproc-per-node=3", "--rdzv-backend=static",
                     "--rdzv-endpoint=job-master-0:23456"):
        assert expected in argv, (expected, argv)
    assert "--nproc-per-node=1" in _argv(LaunchOptions(nproc_per_node="1"))  # a flag wins
    # elastic policy: endpoint and backend from PET_*, the user's rdzv conf kept
    clean_env.setenv("PET_RDZV_ENDPOINT", "job-master-0:29400")
    clean_env.setenv("PET_RDZV_BACKEND", "c10d")
    capsys.readouterr()
    argv = _argv(LaunchOptions())
    assert "--rdzv-backend=c10d" in argv and "--rdzv-conf=is_host=false,join_timeout=900" in argv
    assert "joining the rendezvous at job-master-0:29400 (--nnodes 2; waiting up to 900 s" in capsys.readouterr().err
    for bad in ("join_timeout=abc", "last_call_timeout=0", "keep_alive_interval=-1"):
        clean_env.setenv("PET_RDZV_CONF", bad)
        key, value = bad.split("=")
        with pytest.raises(DdpxError, match=rf"^PET_RDZV_CONF {key}='{value}' must be a whole number above 0$"):
            _argv(LaunchOptions())
    clean_env.setenv("PET_RDZV_CONF", "join_timeout=900")
    clean_env.setenv("PET_NODE_RANK", "one")
    with pytest.raises(DdpxError, match="PET_NODE_RANK='one' is not a number"):
        _argv(LaunchOptions())


@pytest.mark.parametrize("variable, value, flag, message", [
    ("PET_NPROC_PER_NODE", "many", {"nproc_per_node": "1"},
     "PET_NPROC_PER_NODE must be a number of processes >= 1, auto, gpu or cpu, got 'many'"),
    ("PET_MASTER_PORT", "70000", {"master_port": 29500}, "PET_MASTER_PORT must be a port number from 1 to 65535, got 70000"),
    ("PET_NNODES", "two", {"nnodes": "2"}, "PET_NNODES must be a number of nodes >= 1 or MIN:MAX, got 'two'"),
])
def test_a_bad_pet_variable_is_named_before_anything_starts_unless_a_flag_stands_in(clean_env, capsys, variable,
                                                                                   value, flag, message):
    from ddpx.cli import main
    from ddpx.launch.options import check_options

    clean_env.setenv(variable, value)
    with pytest.raises(DdpxError, match=f"^{message}$"):
        check_options(LaunchOptions())
    check_options(LaunchOptions(**flag))  # the flag's value is used: the variable is not read
    assert main(["train", "--nproc-per-node", "0"]) == 2  # a bad flag is named as the flag
    assert main(["train"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-2:] == ["ddpx: error: --nproc-per-node must be a number of processes >= 1, auto, gpu or cpu, got '0'",
                        f"ddpx: error: {message}"]


def test_torchruns_gpu_and_cpu_words_for_the_processes_per_node(clean_env, monkeypatch):
    import torch

    clean_env.setenv("PET_NPROC_PER_NODE", "cpu")  # a TrainJob's numProcPerNode: cpu, without resourcesPerNode
    assert f"--nproc-per-node={os.cpu_count()}" in _argv(LaunchOptions())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    clean_env.setenv("PET_NPROC_PER_NODE", "gpu")
    with pytest.raises(DdpxError, match=r"^nproc-per-node gpu \(from --nproc-per-node, PET_NPROC_PER_NODE or "
                                        r"launch.nproc_per_node\) needs a CUDA GPU, and none is visible"):
        _argv(LaunchOptions())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert "--nproc-per-node=4" in _argv(LaunchOptions())


def test_static_rendezvous_across_nodes_needs_a_node_rank_and_an_address_named_as_given(clean_env):
    _pretend(clean_env, address="10.9.0.1", local=False, local_addr="10.9.0.2", iface="eth0")
    with pytest.raises(DdpxError, match=r"--rdzv-backend static needs --node-rank or PET_NODE_RANK \(0 on the node "
                                        r"at 10.9.0.1:29500\)"):
        _argv(LaunchOptions(nnodes="2", master_addr="10.9.0.1"))
    clean_env.setenv("PET_NNODES", "2")  # a TrainJob's variables without its master: named as such
    with pytest.raises(DdpxError, match=r"^PET_NNODES=2 needs --rdzv-endpoint HOST:PORT or --master-addr "
                                        r"\(PET_RDZV_ENDPOINT or PET_MASTER_ADDR in a Kubeflow job\)"):
        _argv(LaunchOptions())
    with pytest.raises(DdpxError, match=r"^--nnodes 3 needs --rdzv-endpoint"):
        _argv(LaunchOptions(nnodes="3"))


def test_route_to_this_machine_and_its_own_name(clean_env):
    one = net.route_to("127.0.0.1", 1)
    assert (one.local, one.one_machine, one.iface) == (True, True, "lo")
    own = net.route_to(socket.gethostname(), 1)
    assert own.local and not own.one_machine
    if net.is_loopback(own.address):  # Debian-style: the name resolves to loopback, yet others reach us
        assert own.local_addr is None or not net.is_loopback(own.local_addr)


def test_workers_started_without_torchrun_choose_the_interface_to_master(clean_env, capsys):
    clean_env.setattr(net, "route_to", lambda host, port: net.Route(host, port, "10.9.0.1", False, "10.9.0.2", "eth7"))
    process_group.choose_interface("10.9.0.1", 29500, rank=4, local_rank=0)
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == "eth7"
    assert capsys.readouterr().err.startswith("[rank4] ddpx: GLOO_SOCKET_IFNAME=eth7 NCCL_SOCKET_IFNAME=eth7 (the "
                                              "interface that reaches MASTER_ADDR=10.9.0.1;")

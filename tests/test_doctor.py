"""``ddpx doctor``: each check fed situations directly, the CLI on the real machine,
and (root only) a network namespace for an unreachable master and a loopback hostname."""

import json
import os
import random
import socket
import sys

import pytest

from ddpx import doctor, net
from ddpx.doctor import FAIL, OK, WARN
import harness

PROC_NET_ROUTE = """Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0
eth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
ib0\t0000000A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0
"""


def _by_name(checks):
    return {c.name: c for c in checks}


def _port_in_safe_range():
    """A free port above 20000 and below the ephemeral range (what doctor calls healthy)."""
    for _ in range(200):
        port = random.randint(20001, 32000)
        if net.port_is_bindable(port)[0]:
            return port
    pytest.skip("no free port in 20001-32000")


# --- checks fed their inputs --------------------------------------------------------------


def test_route_parsing_picks_longest_prefix_and_default():
    assert net.route_iface_from_proc(PROC_NET_ROUTE) == "eth0"
    assert net.route_iface_from_proc(PROC_NET_ROUTE, "10.0.3.4") == "ib0"
    assert net.route_iface_from_proc(PROC_NET_ROUTE, "192.0.2.77") == "eth0"
    assert net.route_iface_from_proc(PROC_NET_ROUTE, "8.8.8.8") == "eth0"  # via the default route
    assert net.parse_ip_route_get("10.1.2.3 via 10.0.0.1 dev ib0 src 10.0.0.5 uid 0\n    cache") == "ib0"


def test_sockets_on_port_reads_proc_net_tcp():
    text = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 00000000:7345 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1\n"
        "   1: 0100007F:B55E 0100007F:7345 01 00000000:00000000 00:00000000 00000000     0        0 999 1\n"
    )
    assert net.sockets_on_port(0x7345, [text]) == [(4242, "LISTEN")]
    assert net.sockets_on_port(0x7346, [text]) == []


def test_hostname_resolving_to_loopback_without_interface_variable():
    # multi-host gloo run: the exact variable to set, with the default route's interface
    checks = doctor.check_hostname("node1", ["127.0.1.1"], {}, "gloo", multi_host=True, suggested_iface="eth0")
    gloo = _by_name(checks)["gloo iface"]
    assert gloo.status == FAIL
    assert gloo.fix == "export GLOO_SOCKET_IFNAME=eth0"
    assert "Connection refused" in gloo.message
    # one host: only a warning, same fix
    gloo = _by_name(doctor.check_hostname("node1", ["127.0.1.1"], {}, "gloo", False, "eth0"))["gloo iface"]
    assert (gloo.status, gloo.fix) == (WARN, "export GLOO_SOCKET_IFNAME=eth0")
    # the variable set, or a routable hostname: fine
    env = {"GLOO_SOCKET_IFNAME": "ib0"}
    assert _by_name(doctor.check_hostname("node1", ["127.0.1.1"], env, "gloo", True, "eth0"))["gloo iface"].status == OK
    assert _by_name(doctor.check_hostname("node1", ["10.0.0.5"], {}, "gloo", True, "eth0"))["gloo iface"].status == OK


def _route(**kw):
    fields = dict(host="10.0.0.5", port=29400, address="10.0.0.5", local=True, local_addr="10.0.0.5", iface="eth1")
    return net.Route(**{**fields, **kw})


def test_the_endpoints_owner_hosts_the_c10d_store_and_says_why():
    check = doctor.check_store_host("c10d", _route(), None)
    assert check.status == OK and check.message.startswith("this node hosts the c10d store at 10.0.0.5:29400: ")
    assert "is_host=true" in check.message
    joined = doctor.check_store_host("c10d", _route(address="10.0.0.9", host="10.0.0.9", local=False), None)
    assert joined.message == ("the node that owns 10.0.0.9 hosts the c10d store; this node joins it: "
                              "10.0.0.9 is not an address of this machine (is_host=false)")
    # static: node rank 0 must own the address
    wrong = doctor.check_store_host("static", _route(address="10.0.0.9", host="10.0.0.9", local=False), 0)
    assert wrong.status == FAIL and "run node rank 0 on the machine that owns 10.0.0.9" in wrong.fix
    assert doctor.check_store_host("static", _route(), 0).status == OK


def test_interface_ddpx_chooses_and_a_users_own_setting():
    checks = doctor.check_interface(_route(local=False, local_addr="10.0.0.2", host="10.0.0.1"), {})
    assert [c.message for c in checks] == [
        f"{name} unset: ddpx train sets it to eth1 (10.0.0.2, the route to 10.0.0.1)" for name in net.IFNAME_VARS]
    mine = doctor.check_interface(_route(), {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "eth1"})
    assert [c.status for c in mine] == [WARN, OK] and "unset GLOO_SOCKET_IFNAME" in mine[0].fix
    lost = doctor.check_interface(_route(local=False, local_addr=None, iface=None), {})
    assert lost[0].status == FAIL
    # the hostname resolves to loopback, but ddpx train sets the variable: no failure
    gloo = _by_name(doctor.check_hostname("node1", ["127.0.1.1"], {}, "gloo", True, "eth0", "eth1"))["gloo iface"]
    assert gloo.status == OK and "set it to eth1" in gloo.message


def test_unreachable_master_fails_and_refused_warns():
    args = dict(addr="10.9.9.9", port=29500, addresses=["10.9.9.9"], resolve_error="",
                master_is_local=False, route_iface="eth0")
    assert doctor.check_master_address(**args, probe="timeout").status == FAIL
    assert doctor.check_master_address(**args, probe="unreachable: No route to host").status == FAIL
    assert doctor.check_master_address(**args, probe="refused").status == WARN
    assert doctor.check_master_address(**args, probe="open").status == OK
    unresolved = dict(args, addresses=[], resolve_error="Name or service not known")
    check = doctor.check_master_address(**unresolved, probe=None)
    assert check.status == FAIL and "does not resolve" in check.message


def test_port_checks():
    assert doctor.check_port_range(29500, (32768, 60999)).status == OK
    assert doctor.check_port_range(8080, (32768, 60999)).status == WARN
    assert doctor.check_port_range(40000, (32768, 60999)).status == WARN
    busy = doctor.check_master_port(29500, True, False, "Address in use", [(77, "python serve.py")], ["LISTEN"])
    assert busy.status == FAIL and "pid 77 (python serve.py)" in busy.message and "stop pid 77" in busy.fix
    assert doctor.check_master_port(29500, False, False, "", [], []).status == OK  # another host's port


def test_backend_choice_and_gpu_count():
    assert "gloo" in doctor.check_backend(False, 0, False, True, None)[0].message
    assert "nccl" in doctor.check_backend(True, 4, True, True, 4)[0].message
    checks = doctor.check_backend(True, 4, True, True, 8)  # auto falls back to gloo: say so
    assert checks[0].status == FAIL and "gloo" in checks[0].message and "--nproc-per-node 4" in checks[0].fix
    assert doctor.check_backend(True, 2, False, True, None)[0].status == FAIL


def test_nccl_hints_only_on_gpus():
    assert doctor.check_nccl_hints("gloo", {}, [], True, "eth0") == []
    hints = _by_name(doctor.check_nccl_hints("nccl", {}, [], True, "eth0"))
    assert "NCCL_DEBUG=INFO" in hints["nccl debug"].fix
    assert hints["rdma"].status == WARN and "NCCL_SOCKET_IFNAME=eth0" in hints["rdma"].fix
    ib = _by_name(doctor.check_nccl_hints("nccl", {"NCCL_IB_DISABLE": "1"}, ["mlx5_0"], True, "ib0"))
    assert ib["rdma"].status == WARN and "mlx5_0" in ib["rdma"].message


def test_run_checks_on_faked_facts_names_the_variable():
    facts = doctor.Facts(master_addr="node01", master_port=29500, nproc_per_node=None, env={},
                         torch_version="2.x", gloo_available=True, ephemeral_range=(32768, 60999),
                         master_addresses=["10.0.0.1"], master_is_local=True, route_iface="ib0",
                         default_iface="eth0", hostname="node01", host_addresses=["127.0.1.1"])
    checks = doctor.run_checks(facts)
    assert _by_name(checks)["gloo iface"].fix == "export GLOO_SOCKET_IFNAME=eth0"
    assert doctor.exit_code(checks) == 1
    facts.env = {"GLOO_SOCKET_IFNAME": "eth0"}
    assert doctor.exit_code(doctor.run_checks(facts)) == 0


def test_several_nodes_with_a_master_name_resolving_to_loopback_is_a_failure():
    # SLURM node 0: its own name resolves to 127.0.1.1 locally, yet the job spans 4 nodes
    facts = doctor.Facts(master_addr="node01", master_port=29500, nproc_per_node=None, env={},
                         torch_version="2.x", gloo_available=True, master_addresses=["127.0.1.1"],
                         master_is_local=True, route_iface="lo", default_iface="ib0", hostname="node01",
                         host_addresses=["127.0.1.1"], nnodes=4)
    gloo = _by_name(doctor.run_checks(facts))["gloo iface"]
    assert gloo.status == FAIL and gloo.fix == "export GLOO_SOCKET_IFNAME=ib0"
    facts.nnodes = 1
    assert _by_name(doctor.run_checks(facts))["gloo iface"].status == WARN


# --- the CLI on this machine -------------------------------------------------------------


def test_healthy_local_setup_passes_with_json_shape(ranks):
    port = _port_in_safe_range()
    rc, out, err = ranks.cli(["doctor", "--master-addr", "127.0.0.1", "--master-port", port, "--json"], timeout=60)
    report = json.loads(out)
    assert rc == 0, out + err
    assert set(report) == {"ok", "counts", "checks"} and report["ok"] is True
    assert set(report["counts"]) == {"OK", "WARN", "FAIL"} and report["counts"]["FAIL"] == 0
    assert sum(report["counts"].values()) == len(report["checks"])
    for check in report["checks"]:
        assert set(check) == {"name", "status", "message", "fix"}
        assert check["status"] in ("OK", "WARN", "FAIL")
    names = {c["name"]: c for c in report["checks"]}
    assert "gloo" in names["backend"]["message"] and names["master port"]["status"] == "OK"


def test_busy_port_is_detected_with_its_process(ranks):
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        rc, out, err = ranks.cli(["doctor", "--master-port", port], timeout=60)
    assert rc == 1, out + err
    line = next(line for line in out.splitlines() if "master port" in line)
    assert line.startswith("FAIL") and f"{port} is busy" in line
    assert f"pid {os.getpid()}" in line  # found through /proc/net/tcp + /proc/*/fd


def test_collectives_run_allreduce_barrier_and_report_bandwidth(ranks, tmp_path):
    rc, out, err = ranks.cli(["doctor", "--collectives", "--nproc-per-node", "2", "--json", "--timeout", "90",
                            "--master-port", _port_in_safe_range()], timeout=150, env={"TMPDIR": str(tmp_path)})
    assert not list(tmp_path.glob("ddpx-*"))  # the ranks' logs are kept only when a check fails
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    for name in ("init", "allreduce", "barrier", "bandwidth"):
        assert checks[name]["status"] == "OK", (name, checks)
    assert "GB/s" in checks["bandwidth"]["message"]
    hook_checks = [c for n, c in checks.items() if n.startswith("hook ")]
    assert hook_checks, "every ddpx comm hook must be exercised"
    assert all(c["status"] == "OK" for c in hook_checks), hook_checks
    assert rc == 0, out + err


# --- network namespaces (root only) -----------------------------------------------------


netns = pytest.mark.skipif(not harness.netns_available(), reason="needs root and ip netns")


@pytest.fixture
def namespace(two_hosts):
    """``(namespace, interface, address)``: one end of a veth pair, lo up, its peer in another namespace."""
    return two_hosts[0]


def _doctor_in(ranks, tmp_path, ns, *args):
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "ddpx", "doctor", "--json", *map(str, args)]
    (done,) = ranks.commands([cmd], tmp_path, 60, env={"PYTHONPATH": os.getcwd()}, names=["doctor"], split_stderr=True)
    assert not done.hung, done.errors[-3000:]
    return done.returncode, {c["name"]: c for c in json.loads(done.output)["checks"]}


@netns
@pytest.mark.netns
def test_unreachable_master_in_a_namespace(ranks, tmp_path, namespace):
    ns, _, _ = namespace
    # 10.214.0.9 has no route inside the namespace: nothing leaves it
    rc, checks = _doctor_in(ranks, tmp_path, ns, "--master-addr", "10.214.0.9", "--master-port", 29500)
    assert rc == 1
    assert checks["master addr"]["status"] == "FAIL" and "unreachable" in checks["master addr"]["message"]


@netns
@pytest.mark.netns
def test_loopback_hostname_in_a_namespace_names_the_route_interface(ranks, tmp_path, namespace):
    ns, ns_if, address = namespace
    host_addresses, _ = net.resolve(socket.gethostname())
    rc, checks = _doctor_in(ranks, tmp_path, ns, "--master-addr", address, "--master-port", 29500)
    gloo = checks["gloo iface"]
    if host_addresses and all(net.is_loopback(a) for a in host_addresses):
        # a multi-host master address and gloo would bind 127.0.0.1: a failure naming the interface
        assert rc == 1 and gloo["status"] == "FAIL"
        assert gloo["fix"] == f"export GLOO_SOCKET_IFNAME={ns_if}"
    else:
        assert gloo["status"] == "OK"
    assert checks["master addr"]["status"] == "OK" and ns_if in checks["master addr"]["message"]


@netns
@pytest.mark.netns
def test_doctor_takes_train_options_and_names_store_host_interface_and_reachability(ranks, tmp_path, namespace):
    """`ddpx train` -> `ddpx doctor` on each of two namespace hosts whose hostname resolves to loopback."""
    ns, ns_if, address = namespace
    args = ["--nnodes", "1:2", "--max-restarts", "3", "--nproc-per-node", "1", "--rdzv-endpoint",
            f"{address}:29555", "trainer.epochs=3"]
    rc, checks = _doctor_in(ranks, tmp_path, ns, *args)
    assert rc == 0, checks
    assert checks["rdzv host"]["message"].startswith(f"this node hosts the c10d store at {address}:29555: "
                                                     f"{address} is an address of this machine ({ns_if})")
    assert checks["interface"]["message"].startswith(f"NCCL_SOCKET_IFNAME unset: ddpx train sets it to {ns_if}")
    peer = address.rsplit(".", 1)[0] + ".2"
    rc, checks = _doctor_in(ranks, tmp_path, ns, *args[:-2], f"{peer}:29555")  # node 0 seen from a host without it
    assert checks["rdzv host"]["message"].startswith(f"the node that owns {peer} hosts the c10d store")
    # reachable, but its namespace runs no store yet
    assert checks["master addr"]["status"] == WARN
    assert checks["master addr"]["message"] == f"{peer} answers via {ns_if} but nothing listens on 29555"


def test_inside_srun_doctor_checks_the_endpoint_ddpx_train_derives(ranks):
    host = socket.gethostname()
    env = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": f"{host},n2",
           "GLOO_SOCKET_IFNAME": "lo"}
    rc, out, err = ranks.cli(["doctor", "--json"], timeout=60, env=env)
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert checks["master addr"]["message"].startswith(host)
    assert checks["master port"]["message"].startswith("24242")  # 20000 + job id % 20000
    rc, out, err = ranks.cli(["doctor", "--json"], timeout=60, env={**env, "GLOO_SOCKET_IFNAME": ""})
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    # node 0 of two: it hosts the store, and the interface is its default route's, not loopback
    assert checks["rdzv host"]["message"].startswith(f"this node hosts the c10d store at {host}:24242")
    assert "lo " not in checks["gloo iface"]["message"]

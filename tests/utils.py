"""Shared helpers for multi-process tests: free ports, the ``ddpx`` CLI in a
subprocess, and two simulated hosts (network namespaces, root only).

Every helper has a hard timeout so a hung collective fails the test instead of
stalling the suite.
"""

import contextlib
import os
import random
import shutil
import subprocess
import sys
import uuid


from ddpx.launch import free_port  # noqa: F401  (tests import it from here)


def run_cli(args, timeout=120, env=None, cwd=None, python=None, script=None):
    """Run ``python -m ddpx ARGS`` and return ``(returncode, stdout, stderr)``.

    ``env`` entries are added to the current environment (a None value unsets
    one); ``python`` selects an interpreter (e.g. a test venv's); ``script``
    runs an installed ``ddpx`` script instead, as a user types it. The whole process group is killed when
    ``timeout`` seconds pass, and the test fails with what the run printed so far.
    """
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")  # 2 cores, several ranks: avoid oversubscription
    full_env.update(env or {})
    full_env = {k: v for k, v in full_env.items() if v is not None}
    cmd = [script] if script else [python or sys.executable, "-m", "ddpx"]
    cmd += list(map(str, args))
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=cwd,
        start_new_session=True,  # so a timeout can kill torchrun and its workers together
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        raise AssertionError(
            f"`ddpx {' '.join(map(str, args))}` did not finish within {timeout} s\n"
            f"--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-4000:]}"
        )
    return proc.returncode, out, err


def netns_available(tc: bool = False) -> bool:
    """Whether this process may create network namespaces (root, iproute2; ``tc`` too if asked)."""
    if os.geteuid() != 0 or shutil.which("ip") is None or (tc and shutil.which("tc") is None):
        return False
    name = f"{_netns_names()[0]}probe{uuid.uuid4().hex[:6]}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ok


def _netns_names():
    """DDPX_TEST_NETNS="NSPREFIX,VETHPREFIX,A.B": namespace and veth name prefixes and a /16
    of your own, for tests sharing a machine."""
    return os.environ.get("DDPX_TEST_NETNS", "ddpxt,vt,10.213").split(",")


@contextlib.contextmanager
def two_hosts(rate=None):
    """Two namespaces joined by a veth pair: yields ``[(namespace, interface, address)] * 2``
    at 10.213.<n>.1 and .2 (/24; see _netns_names), lo up in both. ``rate`` (tc syntax, e.g. ``"100mbit"``)
    shapes both directions with tbf. Removed on exit, whatever happened."""
    tag = uuid.uuid4().hex[:6]
    ns_prefix, veth_prefix, net16 = _netns_names()
    subnet = f"{net16}.{random.randint(1, 250)}"
    hosts = [(f"{ns_prefix}{tag}{end}", f"{veth_prefix}{tag}{end}", f"{subnet}.{i + 1}") for i, end in enumerate("ab")]

    def sh(*cmd):
        subprocess.run(cmd, check=True, capture_output=True)

    try:
        for ns, _, _ in hosts:
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1])
        for ns, iface, addr in hosts:
            sh("ip", "link", "set", iface, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", iface)
            sh("ip", "-n", ns, "link", "set", iface, "up")
            if rate:
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", iface, "root", "tbf",
                   "rate", rate, "burst", "1mb", "latency", "100ms")
        yield hosts
    finally:
        for ns, _, _ in hosts:  # deleting a namespace deletes its end of the veth pair too
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

"""``elastic.recovery: live`` at launch: this node is its own replica group, a single-node
torchrun job, and the groups of the run meet at the run's Lighthouse (``ddpx lighthouse``)
rather than at a rendezvous.

What the launcher decides for such a group: the options that cannot go with it (``--nnodes``
other than 1, ``--rdzv-endpoint``, ``--node-rank`` above 0, a rendezvous backend other than
static), the group's store (``--master-addr``: this node's address on the route to the
Lighthouse, 127.0.0.1 when the Lighthouse is on loopback; ``--master-port``: a free port
there), and the variables every worker of the group gets (ddpx/rank/launcher_contract.py):
``TORCHFT_LIGHTHOUSE=http://HOST:PORT``, ``TORCHFT_QUORUM_RETRIES`` (``elastic.lighthouse_retries``)
and ``DDPX_REPLICA_GROUP=MASTER_ADDR:MASTER_PORT`` (unique in the run, also for groups that all
run on 127.0.0.1). Before any worker starts: torchft must import and the Lighthouse must accept
connections (waited for up to ``DDPX_LIGHTHOUSE_WAIT_S``, 30 s).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Mapping, MutableMapping, Optional

from .. import net
from ..errors import DdpxError
from ..rank.launcher_contract import LIGHTHOUSE_ENV, QUORUM_RETRIES_ENV, REPLICA_GROUP_ENV
from ..recovery.torchft_import import require_torchft
from . import slurm
from .rendezvous import seconds_from_env
from .options import LaunchOptions, from_environment, named, parse_lighthouse

LIGHTHOUSE_WAIT_ENV = "DDPX_LIGHTHOUSE_WAIT_S"  # how long a group waits for the Lighthouse to accept connections
DEFAULT_LIGHTHOUSE_WAIT_S = 30.0
CONFLICT_FIX = ("under elastic.recovery=live every node is its own replica group: drop --nnodes/--rdzv-endpoint "
                "and give each node --lighthouse HOST:PORT")


def is_live(elastic: Optional[Mapping]) -> bool:
    """Whether the config's ``elastic`` section (None: not given) asks for live recovery."""
    return elastic is not None and elastic.get("recovery") == "live"


def live_options(opts: LaunchOptions, env: Mapping[str, str] = os.environ) -> LaunchOptions:
    """The options after torchrun's ``PET_*`` variables; of a SLURM step only the workers per
    node (each ``srun`` task of a live run is a replica group of its own, not a node of one job)."""
    filled = from_environment(opts, {**env, "DDPX_SLURM": "0"})
    if filled.nproc_per_node is None and slurm.in_slurm_step(env):
        try:
            filled = dataclasses.replace(filled, nproc_per_node=slurm.launch_from_slurm(env).nproc_per_node)
        except DdpxError:
            pass  # no node list: launch.nproc_per_node, as without SLURM
    return filled


def _given(option: str, value, env: Mapping[str, str]) -> str:
    source = named(option, value, env)
    return f"{source}={value}" if source.startswith("PET_") else f"{source} {value}"


def check_live_options(opts: LaunchOptions, launch_cfg, elastic,
                       env: Mapping[str, str] = os.environ) -> tuple[str, int]:
    """One-line errors for what cannot go with live recovery, before anything is probed or
    started: a multi-node option, no Lighthouse, no torchft. The Lighthouse's ``(host, port)``."""
    conflicts = []
    if opts.nnodes is not None and str(opts.nnodes) != "1":
        conflicts.append(_given("nnodes", opts.nnodes, env))
    elif opts.nnodes is None and str(launch_cfg["nnodes"]) != "1":
        conflicts.append(f"launch.nnodes={launch_cfg['nnodes']}")
    if opts.rdzv_endpoint is not None:
        conflicts.append(_given("rdzv_endpoint", opts.rdzv_endpoint, env))
    if opts.node_rank:
        conflicts.append(_given("node_rank", opts.node_rank, env))
    if opts.rdzv_backend not in (None, "static"):
        conflicts.append(_given("rdzv_backend", opts.rdzv_backend, env))
    if conflicts:
        raise DdpxError(f"{', '.join(conflicts)} cannot go with elastic.recovery=live; {CONFLICT_FIX}")
    if not elastic.get("lighthouse"):
        raise DdpxError("elastic.recovery=live needs the run's Lighthouse: give --lighthouse HOST:PORT (where "
                        "`ddpx lighthouse` runs) or set elastic.lighthouse")
    lighthouse = parse_lighthouse(elastic["lighthouse"], "elastic.lighthouse")
    require_torchft("elastic.recovery=live")
    return lighthouse


def lighthouse_wait_s(env: Mapping[str, str] = os.environ) -> float:
    """How long a group waits for the Lighthouse to accept connections."""
    return seconds_from_env(LIGHTHOUSE_WAIT_ENV, DEFAULT_LIGHTHOUSE_WAIT_S, env)


def live_argv(opts: LaunchOptions, lighthouse: tuple[str, int], elastic,
              env: MutableMapping[str, str] = os.environ) -> list[str]:
    """torchrun's rendezvous options for this node's replica group (after
    :func:`check_live_options`); sets the workers' variables in ``env`` and says which group
    this is in one line."""
    host, port = lighthouse
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    route = net.route_to(host, port)
    if route.address is None:
        raise DdpxError(f"cannot resolve the Lighthouse host '{host}' ({route.resolve_error}); give --lighthouse "
                        "the IP address of the machine running `ddpx lighthouse`")
    if opts.master_addr is not None:
        addr = opts.master_addr
        iface = None if route.one_machine else net.interface_of(net.resolve_ipv4(addr))
    elif route.one_machine:
        addr, iface = "127.0.0.1", None  # every group on this machine
    elif route.local_addr is None:
        raise DdpxError(f"this node has no route to the Lighthouse at {shown}; check the address, or give "
                        "--master-addr: this node's address the other nodes reach")
    else:
        addr, iface = route.local_addr, route.iface
    bind = net.resolve_ipv4(addr)
    if opts.master_port is not None:
        net.check_port_free(bind, opts.master_port, "master")
        master_port = opts.master_port
    else:
        master_port = net.free_port(bind)
    group = f"{addr}:{master_port}"
    made = net.choose_socket_ifname(iface, env)
    if made:
        print(f"ddpx: replica group {group}: {' '.join(made)} (the interface that reaches the Lighthouse {host}; "
              f"set these variables yourself to choose another)", file=sys.stderr, flush=True)
    wait_for_lighthouse(route.address, port, shown, group, lighthouse_wait_s(env))
    env.update({LIGHTHOUSE_ENV: f"http://{shown}", QUORUM_RETRIES_ENV: str(elastic["lighthouse_retries"]),
                REPLICA_GROUP_ENV: group})
    print(f"ddpx: replica group {group} of the live run at Lighthouse {shown}", file=sys.stderr, flush=True)
    return ["--nnodes=1", "--rdzv-backend=static", f"--master-addr={addr}", f"--master-port={master_port}",
            "--node-rank=0"]


def wait_for_lighthouse(address: str, port: int, shown: str, group: str, wait_s: float) -> None:
    """Return once the Lighthouse accepts connections; one line when it does not yet, a
    one-line error after ``wait_s`` saying where to start it."""
    probe = net.connect_probe(address, port, timeout=1.0)
    if probe == "open":
        return
    if wait_s > 0:
        print(f"ddpx: replica group {group}: waiting up to {wait_s:g} s for the Lighthouse at {shown} ({probe})",
              file=sys.stderr, flush=True)
        probe = net.wait_for_listener(address, port, time.monotonic() + wait_s) or "open"
        if probe == "open":
            return
    waited = f" after {wait_s:g} s" if wait_s > 0 else ""
    host = shown.rpartition(":")[0].strip("[]")
    raise DdpxError(f"the Lighthouse at {shown} does not answer ({probe}){waited}; start `ddpx lighthouse --port "
                    f"{port}` on {host} first (wait longer with {LIGHTHOUSE_WAIT_ENV}=SECONDS)")

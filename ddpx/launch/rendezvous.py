"""Where the nodes of a multi-node run meet: the rendezvous endpoint, whether this node hosts
torchrun's c10d store, and torchrun's ``--rdzv-conf``."""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Mapping, Optional

from .. import net
from ..errors import DdpxError
from .options import DEFAULT_MASTER_PORT, LaunchOptions, named, parse_endpoint

DEFAULT_RDZV_ID = "ddpx"
RDZV_WAIT_ENV = "DDPX_RDZV_WAIT_S"  # how long a joining node waits for the rendezvous host
DEFAULT_RDZV_WAIT_S = 60.0
RESOLVE_EVERY_S = 1.0  # how often a node asks again for a rendezvous host's name that does not resolve yet
BUSY_ENDPOINT_WAIT_S = 10.0  # how long a busy local endpoint may take to start listening
TORCH_JOIN_TIMEOUT_S = 600  # torchrun's c10d rendezvous join_timeout
RDZV_COUNT_KEYS = ("keep_alive_interval", "keep_alive_max_attempt", "timeout")  # ints to torchrun, as *_timeout
# --nnodes MIN:MAX: a dead node leaves the rendezvous after 3 missed 1 s heartbeats (torch:
# 15 s), and a round with at least MIN nodes closes 3 s after the last one joined (torch:
# 30 s), so a survivor trains again within seconds. PET_RDZV_CONF overrides them.
ELASTIC_RDZV_CONF = {"last_call_timeout": "3", "keep_alive_interval": "1", "keep_alive_max_attempt": "3"}


def rendezvous_route(opts: LaunchOptions, nnodes: str, wait_s: Optional[float] = None) -> Optional[net.Route]:
    """Where the nodes of a multi-node run meet (None on one node): the c10d endpoint,
    or MASTER_ADDR:MASTER_PORT for the static rendezvous (torchrun's way). A host that does not
    resolve yet is waited for up to ``wait_s`` (default: :func:`rendezvous_wait_s`)."""
    if nnodes == "1" and opts.rdzv_endpoint is None:
        return None
    if opts.rdzv_endpoint is not None:
        host, port = parse_endpoint(opts.rdzv_endpoint)
    elif opts.master_addr is not None:
        host, port = opts.master_addr, opts.master_port or DEFAULT_MASTER_PORT
    else:
        source = named("nnodes", nnodes)
        raise DdpxError(f"{source}{'=' if source.startswith('PET_') else ' '}{nnodes} needs --rdzv-endpoint HOST:PORT "
                        "or --master-addr (PET_RDZV_ENDPOINT or PET_MASTER_ADDR in a Kubeflow job): an address of "
                        "node 0 every node can reach")
    wait_to_resolve(host, rendezvous_wait_s() if wait_s is None else wait_s)
    route = net.route_to(host, port)
    if route.address is None:  # resolved a moment ago
        raise DdpxError(f"cannot resolve rendezvous host '{host}' ({route.resolve_error}); use node 0's IP "
                        "address or a name every node resolves")
    return route


def rendezvous_wait_s(env: Mapping[str, str] = os.environ) -> float:
    """How long a node waits for the rendezvous host (its name to resolve, its endpoint to listen)."""
    return seconds_from_env(RDZV_WAIT_ENV, DEFAULT_RDZV_WAIT_S, env)


def seconds_from_env(name: str, default: float, env: Mapping[str, str] = os.environ) -> float:
    """Seconds from variable ``name`` (``default`` where unset); a one-line error for anything
    but a finite number >= 0."""
    value = env.get(name)
    if value is None:
        return default
    try:
        wait_s = float(value)
    except ValueError:
        wait_s = -1.0
    if not 0 <= wait_s < float("inf"):
        raise DdpxError(f"{name}={value!r} must be a number of seconds, 0 or more")
    return wait_s


def wait_to_resolve(host: str, wait_s: float) -> None:
    """Return once ``host`` resolves, asking again every RESOLVE_EVERY_S for up to ``wait_s``:
    node 0's name may resolve only once node 0 runs (on Kubernetes, ``PET_MASTER_ADDR`` names
    the first pod, whose DNS record appears when that pod is up, and the other pods may start
    first). One line when the wait starts; a one-line error naming the host and the wait."""
    addresses, error = net.resolve(host)
    if addresses:
        return
    deadline = time.monotonic() + wait_s
    if wait_s > 0:
        print(f"ddpx: node {socket.gethostname()}: rendezvous host '{host}' does not resolve yet ({error}); "
              f"waiting up to {wait_s:g} s for it (node 0's name may appear only once node 0 runs)",
              file=sys.stderr, flush=True)
    while not addresses and (left := deadline - time.monotonic()) > 0:
        time.sleep(min(RESOLVE_EVERY_S, left))
        addresses, error = net.resolve(host)
    if not addresses:
        waited = f" after waiting {wait_s:g} s" if wait_s > 0 else ""
        longer = f" (wait longer with {RDZV_WAIT_ENV}=SECONDS)" if wait_s > 0 else ""
        raise DdpxError(f"cannot resolve rendezvous host '{host}' ({error}){waited}; use node 0's IP address or a "
                        f"name every node resolves{longer}")


def node_label(route: net.Route) -> str:
    """How messages name this node: its address on the rendezvous network."""
    return f"node {route.local_addr or socket.gethostname()}"


def check_rendezvous(route: net.Route, wait_s: float) -> Optional[bool]:
    """Whether this node hosts the c10d store (None: leave it to torchrun, see below).

    The endpoint must be ours to host (a free port on an address of this machine)
    or reachable within ``wait_s``.
    """
    endpoint = f"{route.host}:{route.port}"
    if net.connect_probe(route.address, route.port, timeout=1.0) == "open":
        return False  # the host node's agent is up (or another agent on this machine serves it)
    if route.local:
        try:
            net.check_port_free(route.address, route.port, "rendezvous")
        except DdpxError:
            # Another agent on this machine bound the endpoint between the probe above and this
            # test (two nodes started at once on one machine): join it once it listens.
            if net.wait_for_listener(route.address, route.port, time.monotonic() + BUSY_ENDPOINT_WAIT_S) is None:
                return False
            raise
        # Several agents on one machine share a loopback endpoint: torchrun's own guess
        # tries to serve and joins when another agent was first.
        return None if route.one_machine else True
    deadline = time.monotonic() + wait_s
    print(f"ddpx: {node_label(route)}: waiting up to {wait_s:.0f} s for the rendezvous endpoint {endpoint} ...",
          file=sys.stderr, flush=True)
    if net.wait_for_listener(route.address, route.port, deadline) is None:
        return False
    raise DdpxError(
        f"{node_label(route)}: rendezvous endpoint {endpoint} is unreachable (nothing accepted a connection for "
        f"{wait_s:.0f} s); start node 0 first, check the address and that the port is open "
        f"(wait longer with {RDZV_WAIT_ENV}=SECONDS; `ddpx doctor` with the same options tells more)"
    )


def is_elastic(nnodes: str) -> bool:
    low, sep, high = nnodes.partition(":")
    return bool(sep) and low != high


def rendezvous_conf(nnodes: str, is_host: Optional[bool], env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """torchrun's --rdzv-conf: ddpx's choices, then the user's PET_RDZV_CONF (which wins)."""
    conf = dict(ELASTIC_RDZV_CONF) if is_elastic(nnodes) else {}
    if is_host is not None:
        conf["is_host"] = "true" if is_host else "false"
    for item in filter(None, env.get("PET_RDZV_CONF", "").split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise DdpxError(f"PET_RDZV_CONF item {item!r} must be KEY=VALUE")
        key, value = key.strip(), value.strip()
        if (key.endswith("_timeout") or key in RDZV_COUNT_KEYS) and not (value.isdigit() and int(value) > 0):
            # torchrun would end in a ValueError traceback
            raise DdpxError(f"PET_RDZV_CONF {key}={value!r} must be a whole number above 0")
        conf[key] = value
    return conf

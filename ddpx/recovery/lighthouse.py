"""``ddpx lighthouse``: torchft's Lighthouse server, which the replica groups of a live run
(``elastic.recovery: live``, each node its own group) ask for a quorum every step.

It runs until SIGTERM (exit 0) or SIGINT (exit 130), then shuts the server down. A busy port
and a missing torchft are one-line errors (exit 2) before anything listens."""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
from typing import Optional

from .. import net
from ..errors import DdpxError
from .torchft_import import require_torchft

DEFAULT_PORT = 29510  # torchft's
DEFAULT_BIND = "0.0.0.0"  # every IPv4 interface
DEFAULT_HEARTBEAT_TIMEOUT_S = 5.0  # torchft's: a group that sent no heartbeat for this long is out of the quorum
# A quorum waits up to this long after the minimum joined for groups that heartbeat but have not
# asked yet. Given explicitly: torchft's server made from Python without it waits far less, and
# three groups then never trained together (each quorum formed when two asked, benchmarks/
# bench_recovery.py; docs/recovery.md). Checked every 100 ms (torchft's tick).
DEFAULT_JOIN_TIMEOUT_S = 60.0
TORCHFT_QUORUM_TICK_MS = 100


def bind_address(bind: str, port: int) -> str:
    """torchft's ``bind``: ``HOST:PORT``, an IPv6 address in brackets."""
    host = bind.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def reach_host(bind: str) -> str:
    """The address to give the nodes' ``--lighthouse``: the bound address, or for every
    interface this machine's address on its default route (127.0.0.1 without one)."""
    host = bind.strip("[]")
    if host not in ("0.0.0.0", "::", ""):
        return host
    return net.source_address(net._DEFAULT_ROUTE_PROBE) or "127.0.0.1"


def check_options(port: int, min_groups: int, heartbeat_timeout_s: float, join_timeout_s: float,
                  quorum_tick_ms: Optional[int]) -> None:
    if not 1 <= port <= 65535:
        raise DdpxError(f"--port must be a port number from 1 to 65535, got {port}")
    if min_groups < 1:
        raise DdpxError(f"--min-groups must be >= 1 (replica groups a quorum needs), got {min_groups}")
    if not heartbeat_timeout_s > 0:
        raise DdpxError(f"--heartbeat-timeout-s must be > 0 seconds, got {heartbeat_timeout_s:g}")
    if not join_timeout_s >= 0:
        raise DdpxError(f"--join-timeout-s must be >= 0 seconds, got {join_timeout_s:g}")
    if quorum_tick_ms is not None and quorum_tick_ms < 1:
        raise DdpxError(f"--quorum-tick-ms must be >= 1, got {quorum_tick_ms}")


def check_port(bind: str, port: int) -> None:
    """A one-line error when ``bind:port`` cannot be listened on (busy, or not this machine's)."""
    host = bind.strip("[]")
    if ":" in host:
        return  # IPv6: ddpx.net's bind test is IPv4; torchft's own error says it
    ok, error = net.port_is_bindable(port, host)
    if ok:
        return
    if error == os.strerror(errno.EADDRINUSE):
        raise DdpxError(f"port {port} on {host} is busy (another Lighthouse or service uses it); "
                        f"stop it or pick another with --port (and give the nodes that port in --lighthouse)")
    raise DdpxError(f"the Lighthouse cannot listen on {host}:{port}: {error}; check --bind and --port")


def serve(port: int = DEFAULT_PORT, bind: str = DEFAULT_BIND, min_groups: int = 1,
          heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S, join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
          quorum_tick_ms: Optional[int] = None) -> int:
    """Run the Lighthouse until SIGTERM (0) or SIGINT (130)."""
    check_options(port, min_groups, heartbeat_timeout_s, join_timeout_s, quorum_tick_ms)
    check_port(bind, port)
    # torchft's Rust server logs every quorum request at INFO (several lines a step): quiet unless
    # asked for (RUST_LOG=info); set before its logger starts
    os.environ.setdefault("RUST_LOG", "error")
    require_torchft("ddpx lighthouse")
    from torchft._torchft import LighthouseServer

    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum, frame):
        received.append(signum)
        stop.set()

    handled = [signal.SIGTERM]
    if signal.getsignal(signal.SIGINT) != signal.SIG_IGN:  # ignored (a background job of a script): stays so
        handled.append(signal.SIGINT)
    previous = {signum: signal.signal(signum, on_signal) for signum in handled}
    try:
        try:
            server = LighthouseServer(
                bind=bind_address(bind, port), min_replicas=min_groups,
                join_timeout_ms=int(round(join_timeout_s * 1000)),
                quorum_tick_ms=quorum_tick_ms, heartbeat_timeout_ms=int(round(heartbeat_timeout_s * 1000)))
        except Exception as exc:  # a port taken since check_port, an address not this machine's
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise DdpxError(f"the Lighthouse cannot start on {bind_address(bind, port)}: {first}") from None
        try:
            groups = f"{min_groups} replica group{'s' if min_groups > 1 else ''}"
            print(f"ddpx lighthouse: listening on {bind_address(bind, port)} (a quorum needs {groups}, waits "
                  f"{join_timeout_s:g} s for more; heartbeat timeout {heartbeat_timeout_s:g} s); start each node with "
                  f"`ddpx train CONFIG --lighthouse {reach_host(bind)}:{port}`", flush=True)
            while not stop.wait(1.0):
                pass
        finally:
            server.shutdown()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    name = signal.Signals(received[0]).name if received else "a signal"
    print(f"ddpx lighthouse: stopped ({name})", file=sys.stderr, flush=True)
    return 130 if received and received[0] == signal.SIGINT else 0

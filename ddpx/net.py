"""Network probes shared by the launcher, ``ddpx doctor``, the workers' store client
and the comm monitor: every socket, address, route and bandwidth probe of ddpx.

Everything here answers a question about *this* machine with a socket, not with
the hostname: where the hostname resolves to loopback (Debian's 127.0.1.1 line,
containers, network namespaces) the hostname says nothing about the interfaces.

* whether an address is this machine's: binding a socket to it succeeds;
* which local address reaches a peer: connect a UDP socket to it (no packet is
  sent) and read ``getsockname()``;
* the interface carrying that address: the one GLOO_SOCKET_IFNAME /
  NCCL_SOCKET_IFNAME should name.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import math
import os
import shutil
import socket
import struct
import subprocess
import time
from dataclasses import dataclass
from typing import MutableMapping, Optional, Sequence

from .errors import DdpxError

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915
# A public address used only to ask the kernel for the default route (UDP connect sends nothing).
_DEFAULT_ROUTE_PROBE = "203.0.113.1"


def resolve(host: str) -> tuple[list[str], str]:
    """IPv4/IPv6 addresses of ``host`` (what getaddrinfo answers) and the error, if any."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        return [], exc.strerror or str(exc)
    seen = []
    for info in infos:
        if info[4][0] not in seen:
            seen.append(info[4][0])
    return seen, ""


def resolve_ipv4(host: str) -> str:
    """The first IPv4 address of ``host``; an unknown name is a one-line error."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as exc:
        raise DdpxError(f"cannot resolve host '{host}' ({exc.strerror}); check the address or DNS") from None


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def is_local_address(addr: str) -> bool:
    """True when ``addr`` belongs to this machine (binding to it succeeds)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, 0))
            return True
        except OSError:
            return False


def source_address(peer: str) -> Optional[str]:
    """This machine's address on the route to ``peer`` (None without a route)."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, 9))  # UDP: picks the route and source address, sends nothing
            return s.getsockname()[0]
        except OSError:
            return None


def interface_of(addr: str) -> Optional[str]:
    """Name of the local interface that carries ``addr``."""
    if is_loopback(addr):
        return "lo"
    if ":" not in addr:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                except OSError:
                    continue  # no IPv4 address on it
                if socket.inet_ntoa(packed[20:24]) == addr:
                    return name
    try:  # secondary and IPv6 addresses: only `ip` lists them
        out = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        fields = line.split()  # "3: eth0    inet 10.0.0.5/24 brd ..."
        if len(fields) > 3 and fields[3].split("/")[0] == addr:
            return fields[1].split("@")[0]
    return None


def connect_probe(addr: str, port: int, timeout: float = 3.0) -> str:
    """``nc -zv ADDR PORT`` in Python: "open", "refused", "timeout", or the OS error text."""
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return "open"
    except ConnectionRefusedError:
        return "refused"
    except socket.timeout:
        return "timeout"
    except OSError as exc:
        if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return "unreachable: " + (exc.strerror or "")
        return exc.strerror or str(exc)


def wait_for_listener(addr: str, port: int, deadline: float) -> Optional[str]:
    """Connect to addr:port until something accepts or the deadline (time.monotonic) passes:
    None once something listens, else the last connect error."""
    delay = 0.05
    while True:
        probe = connect_probe(addr, port, timeout=max(min(deadline - time.monotonic(), 5.0), 0.1))
        if probe == "open":
            return None
        if time.monotonic() >= deadline:
            return probe
        time.sleep(max(min(delay, deadline - time.monotonic()), 0.0))
        delay = min(2 * delay, 1.0)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_bindable(port: int, host: str = "") -> tuple[bool, str]:
    """Can a store listen on ``port``? (the same bind a TCPStore server does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen(1)
        except OSError as exc:
            return False, exc.strerror or str(exc)
    return True, ""


def check_port_free(host: str, port: int, what: str) -> None:
    """Fail with a clear message when ``port`` is already taken on this machine."""
    ok, error = port_is_bindable(port, host)
    if ok:
        return
    if error == os.strerror(errno.EADDRINUSE):
        raise DdpxError(f"{what} port {port} on {host} is busy (another run or service uses it); "
                        f"pick another port or omit it to use a free one")
    raise DdpxError(f"cannot bind {what} {host}:{port}: {error}")


@dataclass
class Route:
    """How this node meets a rendezvous host (the c10d endpoint or MASTER_ADDR)."""

    host: str
    port: int
    address: Optional[str]  # what ``host`` resolves to here (None: it does not)
    local: bool  # ``address`` belongs to this machine
    local_addr: Optional[str]  # this node's address the other nodes reach it at
    iface: Optional[str]  # the interface carrying ``local_addr``
    one_machine: bool = False  # a loopback endpoint: every node runs on this machine
    resolve_error: str = ""

    @property
    def why(self) -> str:
        """Why this node does or does not host the store, in words."""
        if self.address is None:
            return f"{self.host} does not resolve here ({self.resolve_error})"
        shown = self.host if self.host == self.address else f"{self.host} ({self.address})"
        if self.one_machine:
            return f"{shown} is a loopback address: every node runs on this machine and the first to bind the port hosts it"
        if self.local and is_loopback(self.address):
            return (f"{shown} is this machine's own name (it resolves to loopback here); the other nodes reach "
                    f"this machine at {self.local_addr} ({self.iface})")
        if self.local:
            return f"{shown} is an address of this machine ({interface_of(self.address) or 'a binding test'})"
        return f"{shown} is not an address of this machine"


def route_to(host: str, port: int) -> Route:
    """Resolve ``host`` and find this node's side of the route to it."""
    addresses, error = resolve(host)
    if not addresses:
        return Route(host, port, None, False, None, None, resolve_error=error)
    address = next((a for a in addresses if ":" not in a), addresses[0])
    one_machine = host == "localhost" or is_loopback(host.strip("[]"))
    local = is_loopback(address) or is_local_address(address)
    if one_machine:
        local_addr = address
    elif is_loopback(address):
        # This machine's own name resolving to 127.0.1.1 (Debian, containers): the other
        # nodes reach it on the default route's interface.
        local_addr = source_address(_DEFAULT_ROUTE_PROBE)
    else:
        local_addr = source_address(address)
    iface = interface_of(local_addr) if local_addr else None
    return Route(host, port, address, local, local_addr, iface, one_machine)


def choose_socket_ifname(iface: Optional[str], env: MutableMapping[str, str] = os.environ) -> list[str]:
    """Set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to ``iface`` where unset (a user's
    own setting wins); the ``NAME=iface`` assignments made."""
    if not iface:
        return []
    made = []
    for name in IFNAME_VARS:
        if not env.get(name):
            env[name] = iface
            made.append(f"{name}={iface}")
    return made


# --- sockets on a port, routes from /proc and `ip route` (what ddpx doctor reports) ----------

_TCP_STATES = {"01": "ESTABLISHED", "06": "TIME_WAIT", "0A": "LISTEN", "08": "CLOSE_WAIT"}


def sockets_on_port(port: int, proc_net_tcp_texts: Sequence[str]) -> list[tuple[int, str]]:
    """``(inode, state)`` of every socket whose local port is ``port`` (/proc/net/tcp{,6} text)."""
    found = []
    for text in proc_net_tcp_texts:
        for line in text.splitlines()[1:]:
            fields = line.split()
            if len(fields) < 10:
                continue
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port:
                found.append((int(fields[9]), _TCP_STATES.get(fields[3], fields[3])))
    return found


def processes_of_sockets(inodes: set[int], proc_root: str = "/proc") -> list[tuple[int, str]]:
    """``(pid, command line)`` of the processes holding one of the socket ``inodes``."""
    targets = {f"socket:[{i}]" for i in inodes if i}
    owners = []
    if not targets:
        return owners
    for pid in filter(str.isdigit, os.listdir(proc_root)):
        fd_dir = os.path.join(proc_root, pid, "fd")
        try:
            links = {os.readlink(os.path.join(fd_dir, fd)) for fd in os.listdir(fd_dir)}
        except OSError:
            continue  # process gone or not ours to read
        if links & targets:
            try:
                with open(os.path.join(proc_root, pid, "cmdline"), "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                cmd = "?"
            owners.append((int(pid), " ".join(cmd.split())[:80] or "?"))
    return owners


def parse_ip_route_get(text: str) -> Optional[str]:
    """The interface in ``ip route get ADDR`` output (``... dev eth0 src ...``)."""
    fields = text.split()
    for i, word in enumerate(fields[:-1]):
        if word == "dev":
            return fields[i + 1]
    return None


def route_iface_from_proc(proc_net_route: str, addr: Optional[str] = None) -> Optional[str]:
    """Interface of the longest matching IPv4 route in /proc/net/route text
    (the default route when ``addr`` is None)."""
    target = int(ipaddress.IPv4Address(addr)) if addr else None
    best, best_len = None, -1
    for line in proc_net_route.splitlines()[1:]:
        f = line.split()
        if len(f) < 8:
            continue
        # /proc/net/route stores addresses little-endian
        dest = int.from_bytes(bytes.fromhex(f[1]), "little")
        mask = int.from_bytes(bytes.fromhex(f[7]), "little")
        prefix = bin(mask).count("1")
        matches = (dest == 0 and mask == 0) if target is None else (target & mask) == dest
        if matches and prefix > best_len:
            best, best_len = f[0], prefix
    return best


def read_text(path: str) -> str:
    """A file's text (/proc, the doctor's worker reports), "" when it cannot be read."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def route_iface(addr: str) -> Optional[str]:
    """The interface of the route to ``addr``: ``ip route get``, else /proc/net/route."""
    if shutil.which("ip"):
        try:
            out = subprocess.run(["ip", "route", "get", addr], capture_output=True, text=True, timeout=5)
            if out.returncode == 0:
                return parse_ip_route_get(out.stdout)
        except (OSError, subprocess.TimeoutExpired):
            pass
    return proc_route_iface(addr)


def proc_route_iface(addr: str) -> Optional[str]:
    """The interface of the route to ``addr`` in /proc/net/route (None for IPv6)."""
    try:
        return route_iface_from_proc(read_text("/proc/net/route"), addr)
    except ValueError:  # IPv6: /proc/net/route is IPv4 only
        return None


# --- the bandwidth of the process group (ddpx doctor --collectives, the comm monitor, ddpx bench comm) ----


def measure_allreduce_seconds(nbytes: int, iters: int = 5, group=None, device=None, fastest: bool = False) -> float:
    """Median (``fastest``: minimum) time of an fp32 allreduce of ``nbytes`` on
    ``device`` (after one warm-up); rank 0's value, which every rank returns."""
    import torch
    import torch.distributed as dist

    device = torch.device(device or "cpu")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    buf = torch.ones(max(1, nbytes // 4), device=device)
    dist.all_reduce(buf, group=group)
    times = []
    for _ in range(iters):
        sync()
        dist.barrier(group=group)
        t0 = time.perf_counter()
        dist.all_reduce(buf, group=group)
        sync()
        times.append(time.perf_counter() - t0)
    # every rank must use the same number: take rank 0's median
    t = torch.tensor([min(times) if fastest else sorted(times)[len(times) // 2]], dtype=torch.float64, device=device)
    dist.broadcast(t, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return float(t.item())


MAX_ACCUMULATION_ADVICE = 64  # more micro-batches per step change the training (its batch) more than a link is worth


def accumulation_advice(comm_s: float, compute_s: float, accumulation: int = 1) -> Optional[int]:
    """The ``accumulation.steps`` at which compute catches up with the gradient allreduce.

    ``compute_s``: one optimizer step's compute over ``accumulation`` micro-batches, so
    ``k = ceil(accumulation * comm_s / compute_s)`` micro-batches per allreduce make compute at
    least as long as it (what ``ddpx bench comm`` and the comm monitor advise), at most
    MAX_ACCUMULATION_ADVICE. None where a number would not help: compute not known (0 or less:
    the comm monitor's step minus an allreduce that measured longer than the whole step), or
    already at least as long as the allreduce.
    """
    if compute_s <= 0:
        return None
    k = math.ceil(max(1, accumulation) * comm_s / compute_s)
    return min(k, MAX_ACCUMULATION_ADVICE) if k > accumulation else None

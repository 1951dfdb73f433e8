"""The pure checks of ``ddpx doctor``: each a function of its inputs (the resolver's
answer, the environment, /proc text, ...) returning :class:`Check` objects, so
tests can feed it any situation. :mod:`ddpx.doctor.facts` gathers the real inputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from .. import net
from ..net import Route, is_loopback

OK, WARN, FAIL = "OK", "WARN", "FAIL"
DEFAULT_MASTER_PORT = 29500  # torchrun's default
SAFE_PORT_MIN = 20000  # well-known and registered services live below this
CONNECT_TIMEOUT_S = 3.0  # net.connect_probe's default


@dataclass
class Check:
    name: str
    status: str  # OK / WARN / FAIL
    message: str
    fix: str = ""

    def line(self, width: int = 16) -> str:
        text = f"{self.status:<5} {self.name:<{width}} {self.message}"
        return f"{text}  -> fix: {self.fix}" if self.fix else text


# --- backend and versions --------------------------------------------------------------


def check_backend(cuda_available: bool, gpu_count: int, nccl_available: bool,
                  gloo_available: bool, nproc_per_node: Optional[int]) -> list[Check]:
    """The backend `ddpx train` (trainer.backend: auto) will use, and why."""
    if cuda_available and gpu_count > 0:
        if not nccl_available:
            return [Check("backend", FAIL, f"{gpu_count} GPU(s) but this torch has no NCCL",
                          "install a CUDA build of torch with NCCL, or set trainer.backend=gloo (slow)")]
        if nproc_per_node is not None and nproc_per_node > gpu_count:
            # ddpx.rank.process_group.choose_backend("auto") needs one GPU per local process
            return [Check("backend", FAIL, f"gloo on CPU: {nproc_per_node} processes per node but only "
                          f"{gpu_count} GPU(s), so trainer.backend=auto cannot give each its own GPU",
                          f"use --nproc-per-node {gpu_count} (one process per GPU)")]
        return [Check("backend", OK, f"nccl ({gpu_count} CUDA GPU(s) visible; NCCL is the GPU backend)")]
    if not gloo_available:
        return [Check("backend", FAIL, "no GPU and this torch has no gloo backend",
                      "install a torch build with distributed support (pip install torch)")]
    why = "CUDA not available" if not cuda_available else "no CUDA device visible (CUDA_VISIBLE_DEVICES?)"
    return [Check("backend", OK, f"gloo ({why}; gloo is the CPU backend)")]


def check_versions(torch_version: str, cuda_version: Optional[str], nccl_version: Optional[str],
                   gloo_available: bool, extension_error: Optional[str]) -> list[Check]:
    parts = [f"torch {torch_version}", f"CUDA {cuda_version or 'none (CPU build)'}",
             f"NCCL {nccl_version or 'none'}", f"gloo {'yes' if gloo_available else 'no'}"]
    checks = [Check("versions", OK, ", ".join(parts))]
    if extension_error:
        checks.append(Check("extension", FAIL, f"ddpx._C does not load: {extension_error}",
                            "rebuild it: pip install --no-build-isolation -e . (same torch as at build time)"))
    else:
        checks.append(Check("extension", OK, "ddpx._C loads"))
    return checks


# --- ports ------------------------------------------------------------------------------


def check_port_range(port: int, ephemeral: Optional[tuple[int, int]]) -> Check:
    if not 0 < port < 65536:
        return Check("port range", FAIL, f"{port} is not a TCP port", "pick a port in 20000-32767")
    if port <= SAFE_PORT_MIN:
        return Check("port range", WARN, f"{port} is below {SAFE_PORT_MIN}, where services usually listen",
                     f"use a port above {SAFE_PORT_MIN}, e.g. --master-port 29500")
    if ephemeral and ephemeral[0] <= port <= ephemeral[1]:
        return Check("port range", WARN,
                     f"{port} is in the ephemeral range {ephemeral[0]}-{ephemeral[1]}: any outgoing "
                     "connection may take it at random",
                     f"use a port between {SAFE_PORT_MIN} and {ephemeral[0] - 1}")
    return Check("port range", OK, f"{port} is above {SAFE_PORT_MIN} and outside the ephemeral range")


def check_master_port(port: int, master_is_local: bool, bindable: bool, bind_error: str,
                      users: Sequence[tuple[int, str]], states: Sequence[str]) -> Check:
    """Free or busy, and by which process (``users`` from /proc when it tells)."""
    if not master_is_local:
        return Check("master port", OK, f"{port}: the master is another host; this host only connects to it")
    if bindable:
        return Check("master port", OK, f"{port} is free on this host (the master)")
    who = ", ".join(f"pid {pid} ({cmd})" for pid, cmd in users) if users else ""
    if not who and states:
        who = f"sockets in state {', '.join(sorted(set(states)))}"
    detail = f"busy: {who}" if who else f"cannot be bound ({bind_error})"
    fix = "use another port: --master-port / MASTER_PORT (above 20000)"
    if users:
        fix += f", or stop pid {users[0][0]}"
    return Check("master port", FAIL, f"{port} is {detail}", fix)


# --- addresses, routes and interfaces ---------------------------------------------------


def check_master_address(addr: str, port: int, addresses: Sequence[str], resolve_error: str,
                         master_is_local: bool, probe: Optional[str],
                         route_iface: Optional[str]) -> Check:
    """The `nc -zv` test and the interface the route to the master uses."""
    if not addresses:
        return Check("master addr", FAIL, f"{addr} does not resolve ({resolve_error})",
                     "use the master's IP address or a name every node resolves (check /etc/hosts, DNS)")
    via = f" via {route_iface}" if route_iface else ""
    shown = addr if addresses[0] == addr else f"{addr} ({addresses[0]})"
    if master_is_local:
        return Check("master addr", OK, f"{shown} is this host{via}; it will run the rendezvous store")
    if probe == "open":
        return Check("master addr", OK, f"{shown}:{port} reachable{via}: something listens (the master is up)")
    if probe == "refused":
        return Check("master addr", WARN, f"{shown} answers{via} but nothing listens on {port}",
                     "expected before the master starts; if it runs, check the port and its firewall")
    if probe == "timeout":
        return Check("master addr", FAIL, f"{shown}:{port} no answer within {CONNECT_TIMEOUT_S:g} s{via}",
                     "a firewall drops the packets or the address is wrong: open the port between nodes")
    return Check("master addr", FAIL, f"{shown}:{port} {probe}{via}",
                 "no route to the master: use an address on a network every node shares")


def check_hostname(hostname: str, host_addresses: Sequence[str], env: Mapping[str, str],
                   backend: str, multi_host: bool, suggested_iface: Optional[str],
                   chosen_iface: Optional[str] = None) -> list[Check]:
    """Does gloo bind a loopback address? (hostname -> 127.x and no GLOO_SOCKET_IFNAME,
    and no interface ``ddpx train`` chooses: ``chosen_iface``)."""
    checks = []
    gloo_if = env.get("GLOO_SOCKET_IFNAME")
    nccl_if = env.get("NCCL_SOCKET_IFNAME")
    iface = suggested_iface or "<interface>"
    loopback = bool(host_addresses) and all(is_loopback(a) for a in host_addresses)
    if gloo_if:
        checks.append(Check("gloo iface", OK, f"GLOO_SOCKET_IFNAME={gloo_if}"))
    elif chosen_iface:
        checks.append(Check("gloo iface", OK, f"GLOO_SOCKET_IFNAME unset: ddpx train and its workers set it to "
                            f"{chosen_iface}, so gloo does not bind what hostname {hostname!r} resolves to"))
    elif loopback:
        message = (f"hostname {hostname!r} resolves to {host_addresses[0]} and GLOO_SOCKET_IFNAME is unset: "
                   "gloo binds 127.0.0.1 and other hosts get \"Connection refused\"")
        fix = f"export GLOO_SOCKET_IFNAME={iface}"
        status = FAIL if multi_host and backend == "gloo" else WARN
        if not multi_host:
            message += " (fine on one host)"
        checks.append(Check("gloo iface", status, message, fix))
    elif not host_addresses:
        checks.append(Check("gloo iface", WARN, f"hostname {hostname!r} does not resolve: gloo falls back "
                            "to the loopback address", f"export GLOO_SOCKET_IFNAME={iface}"))
    else:
        checks.append(Check("gloo iface", OK, f"hostname {hostname!r} resolves to {host_addresses[0]}; "
                            "GLOO_SOCKET_IFNAME unset (gloo binds that address)"))
    if backend == "nccl":
        if nccl_if:
            checks.append(Check("nccl iface", OK, f"NCCL_SOCKET_IFNAME={nccl_if}"))
        elif chosen_iface:
            checks.append(Check("nccl iface", OK, f"NCCL_SOCKET_IFNAME unset: ddpx train sets it to {chosen_iface}"))
        else:
            checks.append(Check("nccl iface", OK, "NCCL_SOCKET_IFNAME unset: NCCL picks an interface itself",
                                f"if NCCL picks the wrong one (docker0, lo): export NCCL_SOCKET_IFNAME={iface}"))
    return checks


def check_store_host(backend: str, route: Route, node_rank: Optional[int]) -> Check:
    """Which node hosts the rendezvous store, and why (what ``ddpx train`` tells torchrun)."""
    endpoint = f"{route.host}:{route.port}"
    if backend == "c10d":
        if route.one_machine:
            return Check("rdzv host", OK, f"c10d store at {endpoint}: {route.why}")
        if route.local:
            return Check("rdzv host", OK, f"this node hosts the c10d store at {endpoint}: {route.why} "
                         "(ddpx train passes torchrun is_host=true)")
        return Check("rdzv host", OK, f"the node that owns {route.host} hosts the c10d store; this node joins it: "
                     f"{route.why} (is_host=false)")
    where = f"node rank 0 hosts the {backend} store at {endpoint}"
    if node_rank == 0 and not route.local:
        return Check("rdzv host", FAIL, f"{where}, and this is node rank 0, but {route.why}",
                     f"run node rank 0 on the machine that owns {route.host}, or give its address")
    return Check("rdzv host", OK, f"{where}; this node is node rank {node_rank if node_rank is not None else '?'}")


def check_interface(route: Route, env: Mapping[str, str]) -> list[Check]:
    """The interface ddpx train chooses (the route to the rendezvous host), or the user's."""
    if route.one_machine:
        return [Check("interface", OK, f"{route.host} is a loopback address: every node on this machine, "
                      "ddpx sets no interface")]
    if route.iface is None:
        return [Check("interface", FAIL, f"no local address routes to {route.host}",
                      "use an address on a network every node shares (check `ip route`)")]
    mine = f"{route.iface} ({route.local_addr}, the route to {route.host})"
    checks = []
    for name in net.IFNAME_VARS:
        value = env.get(name)
        if not value:
            checks.append(Check("interface", OK, f"{name} unset: ddpx train sets it to {mine}"))
        elif value != route.iface:
            checks.append(Check("interface", WARN, f"{name}={value} (yours, kept) but the route to {route.host} "
                                f"uses {route.iface}", f"unset {name} to let ddpx choose, if {value} is wrong"))
        else:
            checks.append(Check("interface", OK, f"{name}={value} (yours, kept): {mine}"))
    return checks


def check_nccl_hints(backend: str, env: Mapping[str, str], ib_devices: Sequence[str],
                     multi_host: bool, iface: Optional[str]) -> list[Check]:
    if backend != "nccl":
        return []
    checks = []
    if env.get("NCCL_DEBUG"):
        checks.append(Check("nccl debug", OK, f"NCCL_DEBUG={env['NCCL_DEBUG']}"))
    else:
        checks.append(Check("nccl debug", OK, "NCCL_DEBUG unset",
                            "when a run hangs or fails: export NCCL_DEBUG=INFO (shows interface and transport)"))
    if ib_devices:
        if env.get("NCCL_IB_DISABLE", "0") not in ("0", ""):
            checks.append(Check("rdma", WARN, f"InfiniBand/RDMA present ({', '.join(ib_devices)}) but "
                                "NCCL_IB_DISABLE is set", "unset NCCL_IB_DISABLE to use RDMA"))
        else:
            checks.append(Check("rdma", OK, f"InfiniBand/RDMA devices: {', '.join(ib_devices)}"))
    elif multi_host:
        checks.append(Check("rdma", WARN, "no InfiniBand/RDMA device (/sys/class/infiniband): NCCL uses TCP "
                            "sockets between nodes", f"expect lower bandwidth; export NCCL_SOCKET_IFNAME="
                            f"{iface or '<interface>'} on the fastest network"))
    else:
        checks.append(Check("rdma", OK, "no InfiniBand/RDMA device (not needed on one host)"))
    return checks

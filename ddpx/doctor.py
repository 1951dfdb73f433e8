"""``ddpx doctor``: find the usual distributed-training failures before a run does.

Each check is a function of its inputs (the resolver's answer, the environment,
/proc text, ...) returning :class:`Check` objects, so tests can feed it any
situation; :func:`gather_facts` collects the real inputs of this machine and
:func:`run_checks` ties the two together.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Mapping, Optional, Sequence

from . import net
from .net import (Route, connect_probe, free_port, interface_of, is_local_address, is_loopback,  # noqa: F401
                  port_is_bindable, resolve)

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
            # ddpx.distributed.choose_backend("auto") needs one GPU per local process
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


# --- gathering the real inputs ----------------------------------------------------------


@dataclass
class Facts:
    """Everything the checks read, collected from this machine (or faked by tests)."""

    master_addr: str
    master_port: int
    nproc_per_node: Optional[int]
    env: Mapping[str, str]
    torch_version: str = ""
    cuda_available: bool = False
    gpu_count: int = 0
    cuda_version: Optional[str] = None
    nccl_available: bool = False
    nccl_version: Optional[str] = None
    gloo_available: bool = False
    extension_error: Optional[str] = None
    ephemeral_range: Optional[tuple[int, int]] = None
    master_addresses: list = field(default_factory=list)
    master_resolve_error: str = ""
    master_is_local: bool = False
    route_iface: Optional[str] = None
    default_iface: Optional[str] = None
    probe: Optional[str] = None
    port_bindable: bool = True
    port_bind_error: str = ""
    port_users: list = field(default_factory=list)
    port_states: list = field(default_factory=list)
    hostname: str = ""
    host_addresses: list = field(default_factory=list)
    ib_devices: list = field(default_factory=list)
    nnodes: int = 1
    rdzv_backend: str = "static"
    route: Optional[Route] = None  # multi-node: this node's route to the rendezvous host
    node_rank: Optional[int] = None

    @property
    def backend(self) -> str:
        """What trainer.backend=auto picks (ddpx.distributed.choose_backend)."""
        enough = self.nproc_per_node is None or self.nproc_per_node <= self.gpu_count
        return "nccl" if self.cuda_available and self.gpu_count > 0 and self.nccl_available and enough else "gloo"

    @property
    def multi_host(self) -> bool:
        """Several nodes, or a master that is not a loopback address: other hosts take part."""
        if self.nnodes > 1:
            return True
        return bool(self.master_addresses) and not all(is_loopback(a) for a in self.master_addresses)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _route_iface(addr: str) -> Optional[str]:
    if shutil.which("ip"):
        try:
            out = subprocess.run(["ip", "route", "get", addr], capture_output=True, text=True, timeout=5)
            if out.returncode == 0:
                return parse_ip_route_get(out.stdout)
        except (OSError, subprocess.TimeoutExpired):
            pass
    return _proc_route_iface(addr)


def _proc_route_iface(addr: str) -> Optional[str]:
    try:
        return route_iface_from_proc(_read("/proc/net/route"), addr)
    except ValueError:  # IPv6: /proc/net/route is IPv4 only
        return None


def gather_facts(master_addr: str, master_port: int, nproc_per_node: Optional[int],
                 env: Mapping[str, str] = os.environ, nnodes: int = 1, route: Optional[Route] = None,
                 rdzv_backend: str = "static", node_rank: Optional[int] = None) -> Facts:
    import torch
    import torch.distributed as dist

    facts = Facts(master_addr=master_addr, master_port=master_port, nproc_per_node=nproc_per_node, env=dict(env),
                  nnodes=nnodes, route=route, rdzv_backend=rdzv_backend, node_rank=node_rank)
    facts.torch_version = torch.__version__
    facts.cuda_version = torch.version.cuda
    facts.cuda_available = torch.cuda.is_available()
    facts.gpu_count = torch.cuda.device_count() if facts.cuda_available else 0
    facts.nccl_available = dist.is_available() and dist.is_nccl_available()
    if facts.nccl_available:
        try:
            facts.nccl_version = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - version query only; availability is what matters
            facts.nccl_version = "?"
    facts.gloo_available = dist.is_available() and dist.is_gloo_available()
    try:
        import ddpx._C  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any load failure is the finding
        facts.extension_error = f"{type(exc).__name__}: {exc}"
    lo_hi = _read("/proc/sys/net/ipv4/ip_local_port_range").split()
    if len(lo_hi) == 2:
        facts.ephemeral_range = (int(lo_hi[0]), int(lo_hi[1]))

    facts.master_addresses, facts.master_resolve_error = resolve(master_addr)
    if facts.master_addresses:
        first = facts.master_addresses[0]
        facts.master_is_local = is_loopback(first) or is_local_address(first)
        facts.route_iface = _route_iface(first)
        if facts.route_iface == "lo" and not is_loopback(first):
            # one of this host's own addresses: name the interface that carries it
            facts.route_iface = _proc_route_iface(first) or facts.route_iface
        if not facts.master_is_local:
            facts.probe = connect_probe(first, master_port)
    facts.default_iface = route_iface_from_proc(_read("/proc/net/route"))
    if facts.master_is_local:
        facts.port_bindable, facts.port_bind_error = port_is_bindable(master_port)
        if not facts.port_bindable:
            found = sockets_on_port(master_port, [_read("/proc/net/tcp"), _read("/proc/net/tcp6")])
            facts.port_states = [state for _, state in found]
            facts.port_users = processes_of_sockets({inode for inode, _ in found})
    facts.hostname = socket.gethostname()
    facts.host_addresses, _ = resolve(facts.hostname)
    try:
        facts.ib_devices = sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        facts.ib_devices = []
    return facts


def suggested_iface(facts: Facts) -> Optional[str]:
    """The interface to bind: the route to a remote master, else the default route's."""
    if facts.route_iface and facts.route_iface != "lo" and not facts.master_is_local:
        return facts.route_iface
    return facts.default_iface or (facts.route_iface if facts.route_iface != "lo" else None)


def run_checks(facts: Facts) -> list[Check]:
    iface = suggested_iface(facts)
    checks = check_backend(facts.cuda_available, facts.gpu_count, facts.nccl_available,
                           facts.gloo_available, facts.nproc_per_node)
    checks += check_versions(facts.torch_version, facts.cuda_version, facts.nccl_version,
                             facts.gloo_available, facts.extension_error)
    checks.append(check_port_range(facts.master_port, facts.ephemeral_range))
    checks.append(check_master_address(facts.master_addr, facts.master_port, facts.master_addresses,
                                       facts.master_resolve_error, facts.master_is_local, facts.probe,
                                       facts.route_iface))
    if facts.master_addresses:
        checks.append(check_master_port(facts.master_port, facts.master_is_local, facts.port_bindable,
                                        facts.port_bind_error, facts.port_users, facts.port_states))
    chosen = None
    if facts.route is not None:
        checks.append(check_store_host(facts.rdzv_backend, facts.route, facts.node_rank))
        checks += check_interface(facts.route, facts.env)
        chosen = None if facts.route.one_machine else facts.route.iface
    checks += check_hostname(facts.hostname, facts.host_addresses, facts.env, facts.backend,
                             facts.multi_host, iface, chosen)
    checks += check_nccl_hints(facts.backend, facts.env, facts.ib_devices, facts.multi_host, iface)
    return checks


# --- --collectives: real collectives between local processes ---------------------------

COLLECTIVE_BYTES = 32 << 20


def run_collectives(nproc: int, timeout_s: float = 120.0, nbytes: int = COLLECTIVE_BYTES,
                    hooks: Optional[Sequence[str]] = None) -> list[Check]:
    """Start ``nproc`` local gloo processes; run allreduce, barrier and every ddpx hook."""
    nproc = max(2, nproc)
    outdir = tempfile.mkdtemp(prefix="ddpx-doctor-")
    port = free_port()
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   DDPX_DOCTOR_OUT=outdir, DDPX_DOCTOR_BYTES=str(nbytes),
                   DDPX_DOCTOR_TIMEOUT=str(max(10, int(timeout_s / 2))))
        if hooks is not None:
            env["DDPX_DOCTOR_HOOKS"] = ",".join(hooks)
        log = open(os.path.join(outdir, f"rank{rank}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "ddpx.doctor"], env=env,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    hung = [rank for rank, p in enumerate(procs) if p.poll() is None]
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()
    return _collective_report(outdir, procs, hung, timeout_s)


def _collective_report(outdir: str, procs, hung: list[int], timeout_s: float) -> list[Check]:
    results = []
    path = os.path.join(outdir, "rank0.jsonl")
    for line in _read(path).splitlines():
        results.append(json.loads(line))
    checks = []
    for r in results:
        checks.append(Check(r["name"], r["status"], r["message"], r.get("fix", "")))
    if hung:
        stages = []
        for rank in hung:
            done = [json.loads(x)["name"] for x in _read(os.path.join(outdir, f"rank{rank}.jsonl")).splitlines()]
            stages.append(f"rank {rank} after {done[-1] if done else 'start'}")
        checks.append(Check("collectives", FAIL, f"no result within {timeout_s:g} s: {'; '.join(stages)}",
                            "a collective hangs: run with GLOO_SOCKET_IFNAME/NCCL_DEBUG=INFO and check the logs in "
                            + outdir))
    failed = [rank for rank, p in enumerate(procs) if rank not in hung and p.returncode != 0]
    for rank in failed:
        tail = _read(os.path.join(outdir, f"rank{rank}.log")).strip().splitlines()[-1:] or ["?"]
        checks.append(Check("collectives", FAIL, f"rank {rank} exited with {procs[rank].returncode}: {tail[0]}",
                            f"see {outdir}/rank{rank}.log"))
    if not checks:
        checks.append(Check("collectives", FAIL, "the workers reported nothing", f"see the logs in {outdir}"))
    return checks


def _report(name, status, message, fix=""):
    out = os.environ["DDPX_DOCTOR_OUT"]
    rank = int(os.environ["RANK"])
    with open(os.path.join(out, f"rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps({"name": name, "status": status, "message": message, "fix": fix}) + "\n")


def _hook_consistency(name: str, rank: int, world: int, native: bool) -> tuple[str, str]:
    """Two DDP steps of a small multi-bucket model with hook ``name`` (the Python
    hook, or the native C++ one): ranks must agree. Returns (status, message)
    with the relative error of the first step vs the exact mean."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpx.hooks

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    reference = [p.detach().clone() for p in model.parameters()]
    batches = []
    for r in range(world):
        g = torch.Generator().manual_seed(1000 + r)
        batches.append((torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)))
    # the exact averaged gradient, computed locally from every rank's batch
    exact = [torch.zeros_like(p) for p in model.parameters()]
    for x, y in batches:
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        for e, p in zip(exact, model.parameters()):
            e += p.grad / world
    model.zero_grad()
    ddp = DDP(model, bucket_cap_mb=0.1)  # several buckets, the case that breaks naive hooks
    # check the compressed path itself, not the hook's warm-up of plain allreduce
    warm = {"warmup_steps": 0} if "warmup_steps" in ddpx.hooks.make_state(name).options else {}
    if native:
        state = ddpx.hooks.register(ddp, name, native=True, **warm)
        if not getattr(state, "native", False):
            return OK, "no native implementation here; the Python hook is used instead"
    else:
        state, hook = ddpx.hooks.make(name, **warm)
        ddp.register_comm_hook(state, hook)
    x, y = batches[rank]
    worst_spread, rel_err = 0.0, None
    for step in range(2):
        ddp.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        if not torch.isfinite(flat).all():
            return FAIL, f"step {step}: non-finite gradients"
        hi, lo = flat.clone(), flat.clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        worst_spread = max(worst_spread, float((hi - lo).abs().max()))
        if step == 0:
            exact_flat = torch.cat([e.reshape(-1) for e in exact])
            rel_err = float((flat - exact_flat).norm() / exact_flat.norm())
    for p, ref in zip(model.parameters(), reference):  # the hook must not touch parameters
        if not torch.equal(p.detach(), ref):
            return FAIL, "parameters changed during the backward pass"
    if worst_spread > 0:
        return FAIL, f"ranks hold different gradients (max difference {worst_spread:.3g}): models would diverge"
    exact_hook = name in ("allreduce", "fp32", "none", "default")
    if exact_hook and rel_err > 1e-5:
        return FAIL, f"gradient differs from the exact mean (relative error {rel_err:.2g})"
    return OK, f"ranks agree; relative error vs exact mean {rel_err:.2g} (2 steps, several buckets)"


def _collectives_worker() -> int:
    """One rank of ``--collectives`` (started by :func:`run_collectives`)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=float(os.environ.get("DDPX_DOCTOR_TIMEOUT", "60")))
    t0 = time.perf_counter()
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    _report("init", OK, f"{world} gloo processes joined in {time.perf_counter() - t0:.2f} s")
    try:
        small = torch.full((1024,), float(rank + 1))
        dist.all_reduce(small)
        expected = world * (world + 1) / 2
        if torch.all(small == expected):
            _report("allreduce", OK, f"sum of {world} ranks correct ({expected:g})")
        else:
            _report("allreduce", FAIL, f"sum is {small[0].item():g}, expected {expected:g}",
                    "a broken transport: check the interface (GLOO_SOCKET_IFNAME) and MTU")
        t0 = time.perf_counter()
        dist.barrier()
        _report("barrier", OK, f"{(time.perf_counter() - t0) * 1e3:.1f} ms")
        nbytes = int(os.environ.get("DDPX_DOCTOR_BYTES", COLLECTIVE_BYTES))
        seconds = measure_allreduce_seconds(nbytes)
        algbw = nbytes / seconds
        busbw = algbw * 2 * (world - 1) / world
        _report("bandwidth", OK, f"allreduce of {nbytes >> 20} MiB in {seconds * 1e3:.1f} ms: algorithm "
                f"{algbw / 1e9:.2f} GB/s, bus {busbw / 1e9:.2f} GB/s (loopback, {world} processes)")
        names = os.environ.get("DDPX_DOCTOR_HOOKS")
        if names is None:
            try:
                import ddpx.hooks

                names = ",".join(ddpx.hooks.available())
            except Exception as exc:  # noqa: BLE001 - reported, not fatal to the other checks
                _report("hooks", FAIL, f"ddpx.hooks does not load: {exc}", "rebuild ddpx (pip install -e .)")
                names = ""
        for name in filter(None, names.split(",")):
            for native in (False, True):
                label = f"hook {name}" + (" native" if native else "")
                try:
                    status, message = _hook_consistency(name, rank, world, native)
                except Exception as exc:  # noqa: BLE001 - a failing hook is a finding
                    first_line = (str(exc).splitlines() or [""])[0][:160]
                    status, message = FAIL, f"raised {type(exc).__name__}: {first_line}"
                fix = "" if status == OK else (f"do not use comm_hook.name={name}"
                                               + (" with comm_hook.native=true" if native else ""))
                _report(label, status, message, fix)
    finally:
        import gc

        gc.collect()  # the hooks' DDP models go before their process group
        dist.destroy_process_group()
    return 0


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


# --- output -----------------------------------------------------------------------------


def summarize(checks: Sequence[Check]) -> dict:
    counts = {s: sum(c.status == s for c in checks) for s in (OK, WARN, FAIL)}
    return {"ok": counts[FAIL] == 0, "counts": counts, "checks": [asdict(c) for c in checks]}


def format_text(checks: Sequence[Check]) -> str:
    width = max((len(c.name) for c in checks), default=10)
    lines = [c.line(width) for c in checks]
    s = summarize(checks)["counts"]
    lines.append(f"{s[OK]} OK, {s[WARN]} WARN, {s[FAIL]} FAIL")
    return "\n".join(lines)


def exit_code(checks: Sequence[Check]) -> int:
    return 1 if any(c.status == FAIL for c in checks) else 0


if __name__ == "__main__":
    sys.exit(_collectives_worker())

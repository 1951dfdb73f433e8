"""What the checks of ``ddpx doctor`` read, gathered from this machine: :func:`gather_facts`
(every probe it makes is in :mod:`ddpx.net`), and :func:`run_checks`, which
feeds them to the checks of :mod:`ddpx.doctor.checks`."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Mapping, Optional

from .. import net
from ..net import Route, is_loopback
from .checks import (Check, check_backend, check_hostname, check_interface, check_master_address,
                     check_master_port, check_nccl_hints, check_port_range, check_store_host, check_versions)


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
        """What trainer.backend=auto picks (ddpx.rank.process_group.choose_backend)."""
        enough = self.nproc_per_node is None or self.nproc_per_node <= self.gpu_count
        return "nccl" if self.cuda_available and self.gpu_count > 0 and self.nccl_available and enough else "gloo"

    @property
    def multi_host(self) -> bool:
        """Several nodes, or a master that is not a loopback address: other hosts take part."""
        if self.nnodes > 1:
            return True
        return bool(self.master_addresses) and not all(is_loopback(a) for a in self.master_addresses)


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
    lo_hi = net.read_text("/proc/sys/net/ipv4/ip_local_port_range").split()
    if len(lo_hi) == 2:
        facts.ephemeral_range = (int(lo_hi[0]), int(lo_hi[1]))

    facts.master_addresses, facts.master_resolve_error = net.resolve(master_addr)
    if facts.master_addresses:
        first = facts.master_addresses[0]
        facts.master_is_local = is_loopback(first) or net.is_local_address(first)
        facts.route_iface = net.route_iface(first)
        if facts.route_iface == "lo" and not is_loopback(first):
            # one of this host's own addresses: name the interface that carries it
            facts.route_iface = net.proc_route_iface(first) or facts.route_iface
        if not facts.master_is_local:
            facts.probe = net.connect_probe(first, master_port)
    facts.default_iface = net.route_iface_from_proc(net.read_text("/proc/net/route"))
    if facts.master_is_local:
        facts.port_bindable, facts.port_bind_error = net.port_is_bindable(master_port)
        if not facts.port_bindable:
            found = net.sockets_on_port(master_port, [net.read_text("/proc/net/tcp"), net.read_text("/proc/net/tcp6")])
            facts.port_states = [state for _, state in found]
            facts.port_users = net.processes_of_sockets({inode for inode, _ in found})
    facts.hostname = socket.gethostname()
    facts.host_addresses, _ = net.resolve(facts.hostname)
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




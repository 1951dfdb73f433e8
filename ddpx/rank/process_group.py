"""Process-group set-up from torchrun's environment, and its teardown; or a group a
launcher created already (Ray Train's workers, a script's own ``init_process_group``),
trained in and left as found (:func:`adopt`).

Workers join through an explicit client ``TCPStore`` on
``MASTER_ADDR:MASTER_PORT`` (the store torchrun's agent serves) wrapped in a
``PrefixStore`` keyed on ``TORCHELASTIC_RESTART_COUNT``: without the prefix,
workers restarted by torchrun read the previous attempt's gloo addresses and
hang or fail (see DESIGN.md, "Elastic restarts"). Started by anything else
that sets the variables (srun, mpirun, a script), and under ``ddpx train``
across nodes (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``, see ddpx.launch), rank 0
serves a new store for each worker group, as torch's ``env://`` does; without
that nobody would, and every rank would wait for the whole first timeout. The first collective may wait
for slow ranks (``trainer.first_timeout_s``); afterwards a hang is cut short by
``trainer.timeout_s``.
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .. import net
from ..errors import DdpxError


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def choose_backend(requested: str, local_world_size: int) -> str:
    """``auto``: nccl when every local rank has its own GPU, gloo otherwise."""
    if requested != "auto":
        if requested == "nccl" and not torch.cuda.is_available():
            raise DdpxError("trainer.backend=nccl needs CUDA GPUs, and none are visible; use trainer.backend=gloo or auto")
        return requested
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def choose_device(requested: str, backend: str, local_rank: int) -> torch.device:
    """``auto``: ``cuda:LOCAL_RANK`` with nccl (or when GPUs suffice), else cpu."""
    if requested == "auto":
        requested = "cuda" if backend == "nccl" else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise DdpxError("trainer.device=cuda but no CUDA GPU is visible; use trainer.device=cpu or auto")
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    else:
        device = torch.device(requested)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


_served: dict = {}  # MASTER_PORT -> the store this process serves; a second group here reuses it
_groups_created = [0]
# The default group a launcher created, which ddpx trains in (see adopt): the group (a weak
# reference: the launcher's to end), its own timeout to give back, and the store for ddpx's keys;
# "runs" counts the runs adopted here.
_adopted: dict = {"group": lambda: None, "timeout": None, "store": None, "runs": 0}


def init_process_group(backend: str = "auto", device: str = "auto", first_timeout_s: float = 900.0) -> DistInfo:
    """Join the group described by torchrun's environment (a group of one without it), or train
    in the default group that exists already (:func:`adopt`)."""
    if dist.is_available() and dist.is_initialized():
        return adopt(backend, device)
    rank = env_int("RANK", 0)
    world_size = env_int("WORLD_SIZE", 1)
    local_rank = env_int("LOCAL_RANK", 0)
    local_world_size = env_int("LOCAL_WORLD_SIZE", 1)
    backend = choose_backend(backend, local_world_size)
    bound = choose_device(device, backend, local_rank)
    timeout = datetime.timedelta(seconds=first_timeout_s)
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        if world_size > 1:
            choose_interface(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, local_rank)
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent serves it
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        serve = rank == 0 and not agent_store
        client = _served.get(port) if serve else None
        if client is None:
            client = tcp_store(addr, port, rank, serve=serve, timeout=timeout)
            if serve:
                _served[port] = client
        if agent_store:
            prefix = f"ddpx/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        else:
            # The store is new with each worker group: count the groups of this process (the smoke
            # run makes two) instead of restarts, which a survivor's agent and a rejoined host's
            # count differently.
            prefix = f"ddpx/group{_groups_created[0]}/"
        _groups_created[0] += 1
        store = dist.PrefixStore(prefix, client)
    elif world_size == 1:
        store = dist.HashStore()
    else:
        raise DdpxError(f"WORLD_SIZE={world_size} but MASTER_ADDR/MASTER_PORT are not set; start workers with `ddpx train` or torchrun")
    kwargs: dict = {}
    if bound.type == "cuda" and backend == "nccl":
        kwargs["device_id"] = bound  # binds NCCL communicators eagerly to this rank's GPU
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    return DistInfo(rank, world_size, local_rank, local_world_size, backend, bound)


def adopt(backend: str = "auto", device: str = "auto") -> DistInfo:
    """Train in the default group a launcher created (Ray Train's ``TorchTrainer`` does before it
    calls the train loop): rank and world size from the group, the local rank from
    ``LOCAL_RANK`` (Ray and torchrun set it; 0 without). :func:`teardown` leaves the group
    as it was found: not destroyed, its own timeout back. ddpx's keys go in the group's store
    under a prefix of this run's (:func:`run_store`)."""
    found = dist.get_backend()  # "gloo", "nccl", or per device "cpu:gloo,cuda:nccl"
    uses = "nccl" if "nccl" in found else "gloo" if "gloo" in found else found
    if backend not in ("auto", uses):
        raise DdpxError(f"trainer.backend={backend}, but this process already has a process group that uses "
                        f"{found}; use trainer.backend=auto, or create that group with {backend}")
    local_rank = env_int("LOCAL_RANK", 0)
    bound = choose_device(device, uses, local_rank)
    group = dist.distributed_c10d._get_default_group()
    runs = _adopted["runs"] + 1  # every rank runs as many times as the others: the same prefix everywhere
    store = dist.PrefixStore(f"ddpx/run{runs}/", dist.distributed_c10d._get_default_store())
    _adopted.update(group=weakref.ref(group), timeout=group_timeout(group), store=store, runs=runs)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, env_int("LOCAL_WORLD_SIZE", 1), uses, bound)


def group_timeout(group) -> Optional[datetime.timedelta]:
    """The collective timeout ``group`` was created with (None where its backend does not say)."""
    for device in group._device_types:
        options = getattr(group._get_backend(device), "options", None)
        if options is not None:
            return options._timeout
    return None


def in_adopted_group() -> bool:
    """Whether the default group is one a launcher created and ddpx trained in (:func:`adopt`)."""
    return _adopted["group"]() is dist.distributed_c10d._get_default_group()


def adopted_group_id() -> Optional[str]:
    """The group a launcher created, by its store (``store@HOST:PORT`` of its TCPStore, the path
    of a FileStore): the same on every rank of one group, and another group running beside it
    (a second Ray job on the node) has another. None where ddpx created the group, or for a
    store that names no address."""
    if not in_adopted_group():
        return None
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return f"store@{store.host}:{store.port}"
    path = getattr(store, "path", None)
    return f"store@{path}" if path else None


def run_store() -> Optional[dist.Store]:
    """The store for ddpx's own keys during a run (the collectives' watchdog, the failure reports):
    the default group's; in an adopted group, under this run's prefix, so that a second run in
    the same group reads nothing of the first's. None without a group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if in_adopted_group():
        return _adopted["store"]
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def choose_interface(master_addr: str, master_port: int, rank: int, local_rank: int) -> None:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME where unset: the interface that reaches
    MASTER_ADDR (``ddpx train`` chose it already; srun, mpirun or a script did not).
    Otherwise gloo binds what the hostname resolves to, often 127.0.0.1."""
    route = net.route_to(master_addr, master_port)
    if route.one_machine:
        return
    made = net.choose_socket_ifname(route.iface)
    if made and local_rank == 0:
        print(f"[rank{rank}] ddpx: {' '.join(made)} (the interface that reaches MASTER_ADDR={master_addr}; "
              "set these variables yourself to choose another)", file=sys.stderr, flush=True)


def tcp_store(addr: str, port: int, rank: int, serve: bool, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store on addr:port, served here when ``serve``; a failure is one clear line."""
    deadline = time.monotonic() + timeout.total_seconds()
    # torch's TCPStore client prints a C++ stack trace for every failed connect, so
    # wait for a listener with plain connects first: a missing store stays one line.
    unreachable = None if serve else net.wait_for_listener(addr, port, deadline)
    if unreachable is None:
        try:
            left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 5.0))
            return dist.TCPStore(addr, port, is_master=serve, timeout=timeout if serve else left,
                                 wait_for_workers=False)
        except (RuntimeError, ValueError) as exc:  # DistNetworkError / DistStoreError are RuntimeErrors
            if serve:
                raise DdpxError(f"rank 0 cannot serve the rendezvous store on MASTER_PORT={port} "
                                f"({_first_line(exc)}); set MASTER_PORT to a free port") from None
            unreachable = _first_line(exc)
    raise DdpxError(f"rank {rank}: no rendezvous store answered at MASTER_ADDR={addr} MASTER_PORT={port} within "
                    f"{timeout.total_seconds():g} s ({unreachable}); is rank 0 (or torchrun's agent) "
                    "running, and is that address reachable from this host? (trainer.first_timeout_s sets "
                    "the wait)")


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0][:200] if lines else type(exc).__name__


def set_timeout(seconds: float) -> None:
    """Switch the default group to the steady-state timeout (after the first collective)."""
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds))


def agree(signature: Sequence[str], proposal: Any) -> Any:
    """First collective of a run: check every rank loaded the same plugins, take rank 0's ``proposal``.

    One ``all_gather_object`` carries both, so start-up costs one round trip.
    Raises the same :class:`DdpxError` on every rank when a rank differs.
    """
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (list(signature), proposal))
    lists = [names for names, _ in gathered]
    differs = first_disagreement(lists)
    if differs is not None:
        rank, first, mine, theirs = differs
        raise DdpxError(
            f"rank {rank} loaded different plugins than rank 0 (position {first}: {mine} vs {theirs}; "
            f"rank {rank}: {', '.join(lists[rank])}; rank 0: {', '.join(lists[0])}); "
            f"install the same plugins and config on every node"
        )
    return gathered[0][1]


def first_disagreement(lists: Sequence[Sequence]) -> Optional[tuple[int, int, Any, Any]]:
    """``(rank, position, that rank's item, rank 0's item)`` for the first rank whose list differs
    from rank 0's (``"<nothing>"`` past a list's end), or None when every rank's list is rank 0's."""
    reference = lists[0]
    for rank, theirs in enumerate(lists):
        if theirs != reference:
            i = next((i for i, (a, b) in enumerate(zip(reference, theirs)) if a != b), min(len(reference), len(theirs)))
            return (rank, i, theirs[i] if i < len(theirs) else "<nothing>",
                    reference[i] if i < len(reference) else "<nothing>")
    return None


def teardown() -> None:
    """Destroy the default process group if there is one (safe to call twice); an adopted one
    (:func:`adopt`) stays, with its own timeout back.

    Drop your own references to DDP models and comm-hook states first: the
    collection here frees them, and whatever else they left in reference cycles,
    while the group they hold still exists."""
    if dist.is_available() and dist.is_initialized():
        # A DDP reducer that outlives its group makes torch 2.13 + gloo abort now and
        # then ("terminate called without an active exception").
        gc.collect()
        if not in_adopted_group():
            dist.destroy_process_group()
        elif _adopted["timeout"] is not None:
            set_timeout(_adopted["timeout"].total_seconds())
            _adopted["timeout"] = None

"""``ddpx train``'s launcher: validate the config, check the network, run torchrun.

torchrun runs in this process (``torch.distributed.run.parse_args`` + ``run``)
rather than as ``python -m torch.distributed.run`` in a subprocess: the
launcher has already imported torch to validate the config, so a second
interpreter would cost another torch import (seconds) before the first
progress line, and its ``ChildFailedError`` would reach us only as an exit
code instead of an exception we can turn into one line naming the failed rank.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from .errors import DdpxError

WORKER_MODULE = "ddpx.worker"
DONE_DIR_ENV = "DDPX_DONE_DIR"  # each worker that finishes training writes a marker file here
DEFAULT_RDZV_ID = "ddpx"
RDZV_WAIT_ENV = "DDPX_RDZV_WAIT_S"  # how long a joining node waits for the rendezvous host
DEFAULT_RDZV_WAIT_S = 60.0


@dataclass
class LaunchOptions:
    """torchrun options; None means "from config.launch, SLURM or the default"."""

    nproc_per_node: Optional[str] = None
    nnodes: Optional[str] = None
    node_rank: Optional[int] = None
    rdzv_backend: Optional[str] = None
    rdzv_endpoint: Optional[str] = None
    rdzv_id: Optional[str] = None
    max_restarts: Optional[int] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None


def default_nproc() -> int:
    """One worker per GPU, or 2 on a CPU-only machine."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise DdpxError(f"--rdzv-endpoint '{endpoint}' must be HOST:PORT, e.g. 10.0.0.1:29400")
    return host.strip("[]"), int(port)


def _resolve(host: str) -> str:
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as exc:
        raise DdpxError(f"cannot resolve host '{host}' ({exc.strerror}); check the address or DNS") from None


def _is_local(address: str) -> bool:
    """Whether ``address`` belongs to this machine (binding to it succeeds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, 0))
            return True
        except OSError:
            return False


def _can_connect(address: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False


def check_port_free(host: str, port: int, what: str) -> None:
    """Fail with a clear message when ``port`` is already taken on this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise DdpxError(f"{what} port {port} on {host} is busy (another run or service uses it); "
                                f"pick another port or omit it to use a free one") from None
            raise DdpxError(f"cannot bind {what} {host}:{port}: {exc.strerror}") from None


def check_rendezvous(endpoint: str, wait_s: float) -> None:
    """The c10d endpoint must be ours to host (free port) or reachable within ``wait_s``."""
    host, port = parse_endpoint(endpoint)
    address = _resolve(host)
    if _can_connect(address, port):
        return  # the host node's agent is up (or we join a store another local agent serves)
    if _is_local(address):
        check_port_free(address, port, "rendezvous")
        return  # this node hosts the rendezvous store
    deadline = time.monotonic() + wait_s
    print(f"ddpx: waiting up to {wait_s:.0f} s for the rendezvous endpoint {endpoint} ...", file=sys.stderr, flush=True)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        if _can_connect(address, port):
            return
    raise DdpxError(
        f"rendezvous endpoint {endpoint} is unreachable (nothing accepted a connection for {wait_s:.0f} s); "
        f"start node 0 first, check the address and that the port is open (wait longer with {RDZV_WAIT_ENV}=SECONDS)"
    )


def torchrun_argv(opts: LaunchOptions, launch_cfg, config_path: Optional[str], overrides: Sequence[str]) -> list[str]:
    """The torchrun command line (without the program name) for these options.

    Precedence: command-line option > SLURM environment > ``launch`` config section.
    Also checks ports and the rendezvous endpoint before anything starts.
    """
    from . import slurm

    if slurm.in_slurm_step() and opts.nnodes is None and opts.rdzv_endpoint is None:
        job = slurm.launch_from_slurm()
        opts = LaunchOptions(**{**vars(opts), "nnodes": str(job.nnodes), "node_rank": job.node_rank,
                                "rdzv_endpoint": job.rdzv_endpoint, "rdzv_id": opts.rdzv_id or job.rdzv_id,
                                "nproc_per_node": opts.nproc_per_node or job.nproc_per_node})

    nproc = opts.nproc_per_node if opts.nproc_per_node is not None else launch_cfg["nproc_per_node"]
    if str(nproc) == "auto":
        nproc = default_nproc()
    nnodes = str(opts.nnodes if opts.nnodes is not None else launch_cfg["nnodes"])
    max_restarts = opts.max_restarts if opts.max_restarts is not None else launch_cfg["max_restarts"]
    argv = [f"--nproc-per-node={nproc}", f"--nnodes={nnodes}", f"--max-restarts={max_restarts}"]
    multi_node = nnodes != "1" or opts.rdzv_endpoint is not None
    if opts.node_rank is not None:
        argv.append(f"--node-rank={opts.node_rank}")

    if multi_node:
        if opts.rdzv_endpoint is None:
            raise DdpxError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (an address of node 0 every node can reach)")
        backend = opts.rdzv_backend or "c10d"
        wait_s = float(os.environ.get(RDZV_WAIT_ENV, DEFAULT_RDZV_WAIT_S))
        if backend == "c10d":
            check_rendezvous(opts.rdzv_endpoint, wait_s)
        argv += [f"--rdzv-backend={backend}", f"--rdzv-endpoint={opts.rdzv_endpoint}",
                 f"--rdzv-id={opts.rdzv_id or DEFAULT_RDZV_ID}"]
    else:
        # One node: torchrun's static rendezvous on a local port we checked or picked.
        addr = opts.master_addr or "127.0.0.1"
        if opts.master_port is not None:
            check_port_free(_resolve(addr), opts.master_port, "master")
            port = opts.master_port
        else:
            port = free_port(_resolve(addr))
        argv += [f"--rdzv-backend={opts.rdzv_backend or 'static'}", f"--master-addr={addr}", f"--master-port={port}"]
        if opts.rdzv_id:
            argv.append(f"--rdzv-id={opts.rdzv_id}")
        if opts.node_rank is None:
            argv.append("--node-rank=0")

    if str(nproc) != "1":
        # What torchrun would do anyway, minus its four-line warning banner.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The workers (and whatever they start: DataLoader workers, compile workers)
    # import the user's modules from the same directories as this launcher.
    from .config import user_module_dirs

    paths = [*user_module_dirs(config_path), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    argv += ["--module", WORKER_MODULE]
    if config_path is not None:
        argv += ["--config", os.path.abspath(config_path)]
    return argv + list(overrides)


def launch(config_path: Optional[str], overrides: Sequence[str], opts: LaunchOptions) -> int:
    """Validate the config here (one-line errors, nothing spawned), then run torchrun."""
    from .config import load_config

    config = load_config(config_path, overrides)  # raises DdpxError before any worker exists
    argv = torchrun_argv(opts, config.launch, config_path, overrides)
    return run_torchrun(argv)


def run_torchrun(argv: Sequence[str]) -> int:
    from torch.distributed.run import parse_args, run

    args = parse_args(list(argv))
    with tempfile.TemporaryDirectory(prefix="ddpx-done-") as done_dir:
        os.environ[DONE_DIR_ENV] = done_dir  # inherited by the workers torchrun starts
        try:
            return _run_agent(run, args, done_dir)
        finally:
            os.environ.pop(DONE_DIR_ENV, None)


def _run_agent(run, args, done_dir: str) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    try:
        run(args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        others = len(exc.failures) - 1
        more = f" (and {others} more rank{'s' if others > 1 else ''})" if others > 0 else ""
        code = failure.exitcode
        why = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        if _every_local_worker_finished(args, done_dir):
            # Every local worker finished training (process group destroyed, checkpoints
            # written) before one died while Python shut down: torch + gloo can abort
            # there ("terminate called without an active exception"). Nothing was lost.
            print(f"ddpx: warning: training finished; rank {rank} then {why} while exiting{more}", file=sys.stderr)
            return 0
        raise DdpxError(f"training failed: rank {rank} (pid {failure.pid}) {why}{more}; its error is printed above") from None
    except RendezvousError as exc:
        if _every_local_worker_finished(args, done_dir):
            # The agent lost the c10d store because the node hosting it exited first
            # (a known torchrun race at shutdown). Nothing was lost.
            print(f"ddpx: warning: training finished; torchrun's rendezvous shutdown failed: {exc}", file=sys.stderr)
            return 0
        raise DdpxError(f"rendezvous failed: {type(exc).__name__}: {exc}") from None
    except SignalException as exc:
        print(f"ddpx: stopped by {exc.sigval.name}", file=sys.stderr)
        return 128 + int(exc.sigval)
    return 0


def _every_local_worker_finished(args, done_dir: str) -> bool:
    """Whether each worker this agent started wrote its done marker (after its run
    returned and its process group was destroyed)."""
    finished = len(os.listdir(done_dir))
    return finished > 0 and finished >= _local_workers(args)


def _local_workers(args) -> int:
    """Workers this agent starts (torchrun's --nproc-per-node; its aliases count GPUs/CPUs)."""
    try:
        return int(args.nproc_per_node)
    except (TypeError, ValueError):
        return 1

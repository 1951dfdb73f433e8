"""The launch options of ``ddpx train`` (also ``ddpx doctor`` and ``ddpx bench comm``): their
flags, their checks, and where an option not given on the command line comes from
(torchrun's ``PET_*`` variables, else SLURM, else the config's ``launch`` section)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

from ..config import check_nproc
from ..errors import DdpxError
from . import slurm

DEFAULT_MASTER_PORT = 29500  # torchrun's


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
    lighthouse: Optional[str] = None  # ddpx's, not torchrun's: elastic.recovery=live, elastic.lighthouse=HOST:PORT


def add_launch_arguments(p, restarts: bool = True, live: bool = False) -> None:
    """``ddpx train``'s launch options (also ``ddpx bench comm`` and ``ddpx doctor``); ``live``:
    also ``--lighthouse`` (``ddpx train`` only)."""
    p.add_argument("--nproc-per-node", default=None,
                   help="workers on this node (default: launch.nproc_per_node = auto: one per GPU, 2 on CPU)")
    p.add_argument("--nnodes", default=None, help="number of nodes, or MIN:MAX for elastic runs (default: launch.nnodes)")
    p.add_argument("--node-rank", type=int, default=None, help="rank of this node (static rendezvous)")
    p.add_argument("--rdzv-backend", default=None,
                   help="rendezvous backend (default: c10d with --rdzv-endpoint, static with --master-addr or one node)")
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous (node 0's address) for multi-node runs")
    p.add_argument("--rdzv-id", default=None, help="rendezvous id, the same on every node (default: ddpx)")
    if restarts:
        p.add_argument("--max-restarts", type=int, default=None,
                       help="worker-group restarts after a failure (default: launch.max_restarts)")
    p.add_argument("--master-addr", default=None,
                   help="address of the store: one node (default: 127.0.0.1), or node 0 with the static rendezvous")
    p.add_argument("--master-port", type=int, default=None, help="port of that store (default: a free port; 29500 across nodes)")
    if live:
        p.add_argument("--lighthouse", default=None, metavar="HOST:PORT",
                       help="live recovery: this node is its own replica group of the run whose "
                            "`ddpx lighthouse` listens at HOST:PORT (elastic.recovery=live "
                            "elastic.lighthouse=HOST:PORT; docs/recovery.md)")


def options_from_args(args) -> LaunchOptions:
    return LaunchOptions(**{name: getattr(args, name, None) for name in LaunchOptions.__dataclass_fields__})


def default_nproc(word: str = "auto") -> int:
    """Workers for a word of --nproc-per-node: auto, one per GPU or 2 on a CPU-only machine
    (torchrun's auto: one per core); gpu, one per GPU; cpu, one per core."""
    if word == "cpu":
        return os.cpu_count() or 1
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if word == "gpu" and gpus == 0:
        raise DdpxError("nproc-per-node gpu (from --nproc-per-node, PET_NPROC_PER_NODE or launch.nproc_per_node) "
                        "needs a CUDA GPU, and none is visible; use a number of processes or auto")
    return gpus or 2


def parse_lighthouse(value: str, where: str = "--lighthouse") -> tuple[str, int]:
    """``HOST:PORT`` of a Lighthouse (``http://`` in front, as in TORCHFT_LIGHTHOUSE, is fine)."""
    text = str(value).strip()
    text = text[len("http://"):] if text.startswith("http://") else text
    host, sep, port = text.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or "/" in text:
        raise DdpxError(f"{where} '{value}' must be HOST:PORT of the `ddpx lighthouse` of the run, e.g. 10.0.0.1:29510")
    check_port(int(port), f"{where} {value}: the port")
    return host.strip("[]"), int(port)


def live_overrides(opts: LaunchOptions) -> list[str]:
    """The config overrides ``--lighthouse HOST:PORT`` stands for (none without it)."""
    if opts.lighthouse is None:
        return []
    host, port = parse_lighthouse(opts.lighthouse)
    return ["elastic.recovery=live", f"elastic.lighthouse={host}:{port}"]  # no [] around IPv6: a YAML list


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise DdpxError(f"--rdzv-endpoint '{endpoint}' must be HOST:PORT, e.g. 10.0.0.1:29400")
    check_port(int(port), f"--rdzv-endpoint {endpoint}: the port")
    return host.strip("[]"), int(port)


def check_port(port: Optional[int], where: str) -> None:
    if port is not None and not 1 <= int(port) <= 65535:
        raise DdpxError(f"{where} must be a port number from 1 to 65535, got {port}")


def check_options(opts: LaunchOptions, env: Mapping[str, str] = os.environ) -> None:
    """One-line errors for launch options torchrun would reject with a traceback: the flags, and
    the ``PET_*`` variables that stand in for the flags not given (named as such)."""
    opts = from_environment(opts, env)
    check_nproc(opts.nproc_per_node, named("nproc_per_node", opts.nproc_per_node, env))
    check_port(opts.master_port, named("master_port", opts.master_port, env))
    if opts.max_restarts is not None and opts.max_restarts < 0:
        raise DdpxError(f"--max-restarts must be >= 0, got {opts.max_restarts}")
    if opts.node_rank is not None and opts.node_rank < 0:
        raise DdpxError(f"--node-rank must be >= 0, got {opts.node_rank}")
    if opts.lighthouse is not None:
        parse_lighthouse(opts.lighthouse)
    if opts.nnodes is not None and not re.fullmatch(r"[1-9]\d*(:[1-9]\d*)?", str(opts.nnodes)):
        raise DdpxError(f"{named('nnodes', opts.nnodes, env)} must be a number of nodes >= 1 or MIN:MAX, "
                        f"got {opts.nnodes!r}")


def named(option: str, value, env: Mapping[str, str] = os.environ) -> str:
    """How a message names where ``option``'s ``value`` came from: its ``PET_*`` variable when
    that holds the value, else its flag (a flag given on the command line wins over the variable)."""
    variable = f"PET_{option.upper()}"
    return variable if env.get(variable, "").strip() == str(value) else "--" + option.replace("_", "-")



def from_environment(opts: LaunchOptions, env: Mapping[str, str] = os.environ) -> LaunchOptions:
    """Fill the options not given on the command line from torchrun's ``PET_*`` variables
    (how a Kubeflow PyTorchJob configures torchrun), else from SLURM. Flags win."""
    values = vars(opts).copy()
    for name, value in values.items():
        if name in _NOT_TORCHRUN:
            continue
        raw = env.get(f"PET_{name.upper()}")
        if value is None and raw:
            if name in _INT_OPTIONS:
                if not raw.strip().isdigit():
                    raise DdpxError(f"PET_{name.upper()}={raw!r} is not a number; fix or unset it")
                raw = int(raw)
            values[name] = raw
    opts = LaunchOptions(**values)
    if slurm.in_slurm_step(env) and opts.nnodes is None and opts.rdzv_endpoint is None:
        job = slurm.launch_from_slurm(env)
        opts = LaunchOptions(**{**values, "nnodes": str(job.nnodes), "node_rank": job.node_rank,
                                "rdzv_endpoint": job.rdzv_endpoint, "rdzv_id": opts.rdzv_id or job.rdzv_id,
                                "nproc_per_node": opts.nproc_per_node or job.nproc_per_node})
    return opts


_INT_OPTIONS = ("node_rank", "max_restarts", "master_port")
_NOT_TORCHRUN = ("lighthouse",)  # ddpx's own: no PET_* variable stands for it

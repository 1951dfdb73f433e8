"""Launch settings from a SLURM job: ``srun ddpx train CONFIG`` with one task per node.

Each ``srun`` task runs one torchrun agent for its node; the agents meet at a
c10d rendezvous on the first host of the step's node list. Everything is read
from the ``SLURM_*`` variables ``srun`` sets, so a batch script needs no
hand-written ``MASTER_ADDR`` / node-rank logic::

    #SBATCH --nodes=4 --ntasks-per-node=1 --gpus-per-node=8
    srun ddpx train config.yaml

The functions take the environment as an argument so they are testable with a
faked SLURM environment.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

from ..errors import DdpxError

DEFAULT_PORT_BASE = 20000  # ports below ~20000 collide with common services
PORT_SPAN = 20000


@dataclass(frozen=True)
class SlurmLaunch:
    """What torchrun needs for one node of a SLURM job."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    rdzv_id: str
    nproc_per_node: Optional[int]  # None: let the launcher's "auto" decide

    @property
    def rdzv_endpoint(self) -> str:
        return f"{self.master_addr}:{self.master_port}"


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets: ``a[1,2],b`` -> ``a[1,2]``, ``b``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise DdpxError(f"bad SLURM node list {text!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise DdpxError(f"bad SLURM node list {text!r}: unbalanced '['")
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_range_list(spec: str, nodelist: str) -> list[str]:
    """``01-04,07`` -> ``01 02 03 04 07`` (zero padding kept as written)."""
    out = []
    for item in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if not m:
            raise DdpxError(f"bad SLURM node list {nodelist!r}: cannot read range {item!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise DdpxError(f"bad SLURM node list {nodelist!r}: range {item!r} goes backwards")
        width = len(lo)
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def _expand_one(name: str, nodelist: str) -> list[str]:
    """Expand every bracket group of one host pattern (cartesian product, in order)."""
    m = re.search(r"\[([^\[\]]*)\]", name)
    if not m:
        return [name]
    prefix, suffix = name[: m.start()], name[m.end():]
    return [
        prefix + value + rest
        for value in _expand_range_list(m.group(1), nodelist)
        for rest in _expand_one(suffix, nodelist)
    ]


def expand_nodelist(nodelist: str) -> list[str]:
    """Host names of a SLURM node list, like ``scontrol show hostnames``.

    >>> expand_nodelist("node[01-03,07],gpu-a")
    ['node01', 'node02', 'node03', 'node07', 'gpu-a']
    """
    hosts = []
    for part in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_one(part, nodelist))
    return hosts


def _int_env(env: Mapping[str, str], *names: str) -> Optional[int]:
    """First of ``names`` set in ``env``, as an int. SLURM writes some counts as ``8(x2)``."""
    for name in names:
        value = env.get(name)
        if value:
            m = re.match(r"\s*(\d+)", value)
            if not m:
                raise DdpxError(f"{name}={value!r} is not a number; unset it or fix the job script")
            return int(m.group(1))
    return None


def in_slurm_step(env: Mapping[str, str] = os.environ) -> bool:
    """True inside an ``srun`` task of a job (and not disabled with DDPX_SLURM=0).

    Not inside torchrun's workers (they have TORCHELASTIC_RUN_ID): there the
    launcher already ran.
    """
    if env.get("DDPX_SLURM", "1").lower() in ("0", "false", "no", "off"):
        return False
    if "TORCHELASTIC_RUN_ID" in env:
        return False
    return bool(env.get("SLURM_JOB_ID")) and ("SLURM_NODEID" in env or "SLURM_PROCID" in env)


def master_port(env: Mapping[str, str], job_id: str) -> int:
    """MASTER_PORT if set, else a port above 20000 derived from the job id, so
    two jobs sharing a node rarely collide."""
    explicit = _int_env(env, "MASTER_PORT")
    if explicit is not None:
        return explicit
    digits = re.sub(r"\D", "", job_id) or "0"
    return DEFAULT_PORT_BASE + int(digits) % PORT_SPAN


def launch_from_slurm(env: Mapping[str, str] = os.environ) -> SlurmLaunch:
    """Derive nnodes, node rank, rendezvous endpoint/id and nproc from ``SLURM_*``."""
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        raise DdpxError("not inside a SLURM job (SLURM_JOB_ID unset); run under srun or sbatch")
    nnodes = _int_env(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise DdpxError("SLURM_JOB_NODELIST is unset; run `ddpx train` through srun inside the job")
    hosts = expand_nodelist(nodelist)
    if nnodes is None:
        nnodes = len(hosts)
    node_rank = _int_env(env, "SLURM_NODEID", "SLURM_PROCID")
    if node_rank is None:
        node_rank = 0
    ntasks = _int_env(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if ntasks is not None and ntasks > nnodes:
        raise DdpxError(
            f"srun started {ntasks} tasks on {nnodes} node(s); ddpx starts the workers of a node "
            "itself: use one task per node (srun --ntasks-per-node=1 ddpx train ...)"
        )
    if not 0 <= node_rank < nnodes:
        raise DdpxError(f"SLURM node rank {node_rank} is outside 0..{nnodes - 1}; check SLURM_NODEID")
    gpus = _int_env(env, "SLURM_GPUS_ON_NODE")
    per_node_tasks = _int_env(env, "SLURM_NTASKS_PER_NODE")
    if gpus:
        nproc = gpus
    elif per_node_tasks and per_node_tasks > 1:
        nproc = per_node_tasks  # the allocation asked for N workers per node
    else:
        nproc = None
    return SlurmLaunch(
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=hosts[0],
        master_port=master_port(env, job_id),
        rdzv_id=str(job_id),
        nproc_per_node=nproc,
    )

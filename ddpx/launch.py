"""``ddpx train``'s launcher: validate the config, check the network, run torchrun.

torchrun runs in this process (``torch.distributed.run.parse_args`` + ``run``)
rather than as ``python -m torch.distributed.run`` in a subprocess: the
launcher has already imported torch to validate the config, so a second
interpreter would cost another torch import (seconds) before the first
progress line, and its ``ChildFailedError`` would reach us only as an exit
code instead of an exception we can turn into one line naming the failed rank.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from . import net, slurm
from .config import check_nproc, default_run_dir, load_config, user_module_dirs
from .errors import DdpxError, TrainingDiverged

WORKER_MODULE = "ddpx.worker"
DONE_DIR_ENV = "DDPX_DONE_DIR"  # each worker that finishes training writes a marker file here
LAUNCHER_PID_ENV = "DDPX_LAUNCHER_PID"  # the workers stop when this process dies (ddpx.worker)
DEFAULT_RDZV_ID = "ddpx"
RDZV_WAIT_ENV = "DDPX_RDZV_WAIT_S"  # how long a joining node waits for the rendezvous host
DEFAULT_RDZV_WAIT_S = 60.0
BUSY_ENDPOINT_WAIT_S = 10.0  # how long a busy local endpoint may take to start listening
DEFAULT_MASTER_PORT = 29500  # torchrun's
TORCH_JOIN_TIMEOUT_S = 600  # torchrun's c10d rendezvous join_timeout
SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
RDZV_COUNT_KEYS = ("keep_alive_interval", "keep_alive_max_attempt", "timeout")  # ints to torchrun, as *_timeout
# --nnodes MIN:MAX: a dead node leaves the rendezvous after 3 missed 1 s heartbeats (torch:
# 15 s), and a round with at least MIN nodes closes 3 s after the last one joined (torch:
# 30 s), so a survivor trains again within seconds. PET_RDZV_CONF overrides them.
ELASTIC_RDZV_CONF = {"last_call_timeout": "3", "keep_alive_interval": "1", "keep_alive_max_attempt": "3"}


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


def add_launch_arguments(p, restarts: bool = True) -> None:
    """``ddpx train``'s launch options (also ``ddpx bench comm`` and ``ddpx doctor``)."""
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


def split_config_and_overrides(config, overrides):
    """``ddpx train trainer.epochs=3`` means: default config, one override."""
    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        return None, [config, *overrides]
    for item in overrides:
        if "=" not in item:
            raise DdpxError(f"unexpected argument '{item}': after the config file only KEY=VALUE overrides may follow")
    return config, list(overrides)


def options_from_args(args) -> LaunchOptions:
    return LaunchOptions(**{name: getattr(args, name, None) for name in LaunchOptions.__dataclass_fields__})


def default_nproc() -> int:
    """One worker per GPU, or 2 on a CPU-only machine."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise DdpxError(f"--rdzv-endpoint '{endpoint}' must be HOST:PORT, e.g. 10.0.0.1:29400")
    check_port(int(port), f"--rdzv-endpoint {endpoint}: the port")
    return host.strip("[]"), int(port)


def check_port(port: Optional[int], where: str) -> None:
    if port is not None and not 1 <= int(port) <= 65535:
        raise DdpxError(f"{where} must be a port number from 1 to 65535, got {port}")


def check_options(opts: LaunchOptions) -> None:
    """One-line errors for launch options torchrun would reject with a traceback."""
    check_nproc(opts.nproc_per_node, "--nproc-per-node")
    check_port(opts.master_port, "--master-port")
    if opts.max_restarts is not None and opts.max_restarts < 0:
        raise DdpxError(f"--max-restarts must be >= 0, got {opts.max_restarts}")
    if opts.node_rank is not None and opts.node_rank < 0:
        raise DdpxError(f"--node-rank must be >= 0, got {opts.node_rank}")
    if opts.nnodes is not None and not re.fullmatch(r"[1-9]\d*(:[1-9]\d*)?", str(opts.nnodes)):
        raise DdpxError(f"--nnodes must be a number of nodes >= 1 or MIN:MAX, got {opts.nnodes!r}")


def model_bytes(config) -> Optional[int]:
    """The model's parameter bytes, built on the meta device (no memory, no data); None
    when the model cannot be built there."""
    import torch

    from .imports import instantiate

    try:
        with torch.device("meta"):
            model = instantiate(config.model, "model")
        return sum(p.numel() * p.element_size() for p in model.parameters())
    except Exception:
        return None


def check_run_dir(run_dir: str, config) -> None:
    """Before any worker starts: ``run_dir`` can be created and written (its nearest existing
    directory is writable: nothing is created here), no other run
    holds it (ddpx/runlock.py), and its file system has room for about one checkpoint
    (weights plus optimizer state, counted as 3x the parameters)."""
    import shutil

    from .runlock import job_id, read_holder, refusal, stale_reason

    path = Path(run_dir).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())  # nothing is created here
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        why = "not a directory" if not existing.is_dir() else "no write permission or a read-only file system"
        raise DdpxError(f"run_dir {run_dir} is not writable ({existing}: {why}); choose another with run_dir=DIR")
    holder = read_holder(path)
    if holder and holder.get("job") != job_id() and stale_reason(holder) is None:
        raise DdpxError(refusal(path, holder))
    params = model_bytes(config)
    if params:
        needed, free = 3 * params, shutil.disk_usage(existing).free
        if free < needed:
            raise DdpxError(f"run_dir {run_dir} has {free / 2**20:.0f} MB free, a checkpoint needs about "
                            f"{needed / 2**20:.0f} MB; free some space or choose another run_dir")


def from_environment(opts: LaunchOptions, env: Mapping[str, str] = os.environ) -> LaunchOptions:
    """Fill the options not given on the command line from torchrun's ``PET_*`` variables
    (how a Kubeflow PyTorchJob configures torchrun), else from SLURM. Flags win."""
    values = vars(opts).copy()
    for name, value in values.items():
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


def rendezvous_route(opts: LaunchOptions, nnodes: str) -> Optional[net.Route]:
    """Where the nodes of a multi-node run meet (None on one node): the c10d endpoint,
    or MASTER_ADDR:MASTER_PORT for the static rendezvous (torchrun's way)."""
    if nnodes == "1" and opts.rdzv_endpoint is None:
        return None
    if opts.rdzv_endpoint is not None:
        host, port = parse_endpoint(opts.rdzv_endpoint)
    elif opts.master_addr is not None:
        host, port = opts.master_addr, opts.master_port or DEFAULT_MASTER_PORT
    else:
        raise DdpxError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (an address of node 0 every node can reach)")
    route = net.route_to(host, port)
    if route.address is None:
        raise DdpxError(f"cannot resolve rendezvous host '{host}' ({route.resolve_error}); use node 0's IP "
                        "address or a name every node resolves")
    return route


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


def torchrun_argv(opts: LaunchOptions, launch_cfg, config_path: Optional[str], overrides: Sequence[str]) -> list[str]:
    """The torchrun command line (without the program name) for these options.

    Precedence: command-line option > torchrun's PET_* variables > SLURM > ``launch`` config section.
    Also checks ports and the rendezvous endpoint, and picks this node's network
    interface, before anything starts.
    """
    opts = from_environment(opts)
    nproc = opts.nproc_per_node if opts.nproc_per_node is not None else launch_cfg["nproc_per_node"]
    if str(nproc) == "auto":
        nproc = default_nproc()
    nnodes = str(opts.nnodes if opts.nnodes is not None else launch_cfg["nnodes"])
    max_restarts = opts.max_restarts if opts.max_restarts is not None else launch_cfg["max_restarts"]
    argv = [f"--nproc-per-node={nproc}", f"--nnodes={nnodes}", f"--max-restarts={max_restarts}"]
    if opts.node_rank is not None:
        argv.append(f"--node-rank={opts.node_rank}")

    route = rendezvous_route(opts, nnodes)
    if route is not None:
        endpoint = f"{route.host}:{route.port}"
        backend = opts.rdzv_backend or ("c10d" if opts.rdzv_endpoint else "static")
        argv += [f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={opts.rdzv_id or DEFAULT_RDZV_ID}"]
        if backend == "c10d":
            is_host = check_rendezvous(route, float(os.environ.get(RDZV_WAIT_ENV, DEFAULT_RDZV_WAIT_S)))
            conf = rendezvous_conf(nnodes, is_host)
            if conf:
                argv.append("--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items()))
            if route.local_addr and not os.environ.get("PET_LOCAL_ADDR"):
                # The workers' MASTER_ADDR: otherwise the rank-0 agent's getfqdn(), often "localhost".
                argv.append(f"--local-addr={route.local_addr}")
        elif opts.node_rank is None:
            raise DdpxError(f"--rdzv-backend {backend} needs --node-rank (0 on the node at {endpoint})")
        made = [] if route.one_machine else net.choose_socket_ifname(route.iface)
        if made:
            print(f"ddpx: {node_label(route)}: {' '.join(made)} (the interface that reaches {route.host}; "
                  "set these variables yourself to choose another)", file=sys.stderr, flush=True)
        if backend == "c10d":  # torchrun says nothing while it waits, and a node that never comes costs minutes
            wait = conf.get("join_timeout", TORCH_JOIN_TIMEOUT_S)
            print(f"ddpx: {node_label(route)}: joining the rendezvous at {endpoint} (--nnodes {nnodes}; waiting up "
                  f"to {wait} s for the other nodes)", file=sys.stderr, flush=True)
    else:
        # One node: torchrun's static rendezvous on a local port we checked or picked.
        addr = opts.master_addr or "127.0.0.1"
        if opts.master_port is not None:
            net.check_port_free(net.resolve_ipv4(addr), opts.master_port, "master")
            port = opts.master_port
        else:
            port = net.free_port(net.resolve_ipv4(addr))
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
    paths = [*user_module_dirs(config_path), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    argv += ["--module", WORKER_MODULE]
    if config_path is not None:
        argv += ["--config", os.path.abspath(config_path)]
    return argv + list(overrides)


LAUNCH_RECORD = "ddpx-launch.json"  # in run_dir: the config and overrides that started it (for --resume)


class WorkerCrashed(DdpxError):
    """A worker failed with something other than bad input (exit 1, as docs/checkpoints.md says)."""

    exit_code = 1


def launch(config_path: Optional[str], overrides: Sequence[str], opts: LaunchOptions) -> int:
    """Validate the config here (one-line errors, nothing spawned), then run torchrun.
    When training does not finish, the last line says how to resume."""
    from .runlock import JOB_ENV

    config = load_config(config_path, overrides)  # raises DdpxError before any worker exists
    check_options(opts)
    run_dir = config.run_dir
    if run_dir is None:  # one for the whole launch: a restarted worker group resumes there
        run_dir = default_run_dir()
        overrides = [*overrides, f"run_dir={run_dir}"]
    given_job = os.environ.get(JOB_ENV)
    os.environ[JOB_ENV] = given_job or job_identity(opts)  # the run_dir lock's owner (ddpx/runlock.py)
    started = False
    try:
        check_run_dir(run_dir, config)
        argv = torchrun_argv(opts, config.launch, config_path, overrides)  # checks ports, nothing created yet
        _record_launch(run_dir, config_path, overrides)
        started = True
        code = run_torchrun(argv)
    except DdpxError:
        if started:
            _print_resume_command(config_path, overrides, run_dir)
        raise
    finally:
        if given_job is None:
            os.environ.pop(JOB_ENV, None)
    if code != 0:
        _print_resume_command(config_path, overrides, run_dir)
    return code


def job_identity(opts: LaunchOptions) -> str:
    """This launch's job for the run_dir lock: the rendezvous every node of a multi-node job
    names alike, or this launcher's host and pid on one node."""
    opts = from_environment(opts)
    if opts.rdzv_endpoint:
        return f"{opts.rdzv_id or DEFAULT_RDZV_ID}@{opts.rdzv_endpoint}"
    if opts.master_addr and opts.nnodes not in (None, "1"):
        return f"{opts.rdzv_id or DEFAULT_RDZV_ID}@{opts.master_addr}:{opts.master_port or DEFAULT_MASTER_PORT}"
    return f"{socket.gethostname()}:{os.getpid()}"


def resume_command(config_path: Optional[str], overrides: Sequence[str], run_dir: str) -> str:
    import shlex

    kept = [o for o in overrides if not o.startswith("run_dir=")]
    words = ["ddpx", "train", *([config_path] if config_path else []), *kept, f"run_dir={run_dir}"]
    return " ".join(shlex.quote(str(w)) for w in words)


def _print_resume_command(config_path, overrides, run_dir) -> None:
    print(f"ddpx: to resume this run: {resume_command(config_path, overrides, run_dir)}", file=sys.stderr,
          flush=True)


def _record_launch(run_dir: str, config_path: Optional[str], overrides: Sequence[str]) -> None:
    import json

    record = {"config": os.path.abspath(config_path) if config_path else None,
              "overrides": [o for o in overrides if not o.startswith("run_dir=")], "started": time.time()}
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        Path(run_dir, LAUNCH_RECORD).write_text(json.dumps(record))
    except OSError:
        pass  # check_run_dir found it writable; a vanishing directory shows up in the workers


def newest_run(config_path: Optional[str], runs: Optional[str] = None) -> str:
    """``ddpx train CONFIG --resume``: the newest run directory under ``runs/`` (where
    runs without ``run_dir`` go) that was started with this config file."""
    import json

    wanted = os.path.abspath(config_path) if config_path else None
    base = Path(runs or os.path.dirname(default_run_dir()))
    found = []
    for record in base.glob(f"*/{LAUNCH_RECORD}"):
        try:
            data = json.loads(record.read_text())
        except (OSError, ValueError):
            continue
        if data.get("config") == wanted:
            found.append((float(data.get("started", 0)), str(record.parent)))
    if not found:
        raise DdpxError(f"--resume: no run of {config_path or 'the built-in config'} under {base}; "
                        "pass the run directory: --resume RUN_DIR (or run_dir=RUN_DIR)")
    return max(found)[1]


def run_torchrun(argv: Sequence[str]) -> int:
    from torch.distributed.run import parse_args, run

    args = parse_args(list(argv))
    with tempfile.TemporaryDirectory(prefix="ddpx-done-") as done_dir:
        env = {DONE_DIR_ENV: done_dir, LAUNCHER_PID_ENV: str(os.getpid())}  # inherited by the workers torchrun starts
        if args.rdzv_backend == "c10d" and SHARE_STORE_ENV not in os.environ:
            # A store per worker group, served by its rank 0 (see ddpx.distributed): the agents'
            # shared store would keep the previous group's keys, namespaced by each agent's own
            # restart count, which differs between a survivor and a host that rejoined.
            env[SHARE_STORE_ENV] = "1"
        os.environ.update(env)
        try:
            return _run_agent(run, args, done_dir)
        finally:
            for name in env:
                os.environ.pop(name, None)


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
        if code == TrainingDiverged.exit_code:
            raise TrainingDiverged("training diverged (the reason is printed above)") from None
        why = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        if _every_local_worker_finished(args, done_dir):
            # Every local worker finished training (process group destroyed, checkpoints
            # written) before one died while Python shut down: torch + gloo can abort
            # there ("terminate called without an active exception"). Nothing was lost.
            print(f"ddpx: warning: training finished; rank {rank} then {why} while exiting{more}", file=sys.stderr)
            return 0
        node = f"node {args.local_addr}: " if args.local_addr else ""
        message = f"{node}training failed: rank {rank} (pid {failure.pid}) {why}{more}; its error is printed above"
        if code == DdpxError.exit_code:  # the worker found bad input (one line above): exit 2 too
            raise DdpxError(message) from None
        raise WorkerCrashed(message) from None
    except RendezvousError as exc:
        if _every_local_worker_finished(args, done_dir):
            # The agent lost the c10d store because the node hosting it exited first
            # (a known torchrun race at shutdown). Nothing was lost.
            print(f"ddpx: warning: training finished; torchrun's rendezvous shutdown failed: {exc}", file=sys.stderr)
            return 0
        raise DdpxError(_rendezvous_failure(args, exc)) from None
    except SignalException as exc:
        print(f"ddpx: stopped by {exc.sigval.name}", file=sys.stderr)
        return 128 + int(exc.sigval)
    return 0


def _rendezvous_failure(args, exc) -> str:
    """One line naming this node, the endpoint and the fix."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

    node = f"node {args.local_addr or socket.gethostname()}"
    endpoint = args.rdzv_endpoint
    host = endpoint.rpartition(":")[0]
    if isinstance(exc, RendezvousConnectionError):
        return (f"{node}: lost the rendezvous store at {endpoint} (hosted by the node that owns {host}): that node "
                "stopped or is unreachable from here; its log says why. Start the job again on every node "
                "(`ddpx doctor` with the same options checks the address)")
    if isinstance(exc, RendezvousTimeoutError):
        return (f"{node}: the rendezvous at {endpoint} did not complete in time ({args.nnodes} nodes expected): "
                "start `ddpx train` with the same --rdzv-endpoint and --rdzv-id on the other nodes")
    first = (str(exc).splitlines() or [""])[0]
    return (f"{node}: rendezvous at {endpoint} failed ({type(exc).__name__}: {first}); check that the node that "
            f"owns {host} runs (`ddpx doctor` with the same options)")


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

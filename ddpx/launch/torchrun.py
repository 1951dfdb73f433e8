"""torchrun, run in this process: its command line for the launch options, the agent, and
a failed worker or rendezvous turned into one line.

torchrun runs in this process (``torch.distributed.run.parse_args`` + ``run``)
rather than as ``python -m torch.distributed.run`` in a subprocess: the
launcher has already imported torch to validate the config, so a second
interpreter would cost another torch import (seconds) before the first
progress line, and its ``ChildFailedError`` would reach us only as an exit
code instead of an exception we can turn into one line naming the failed rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import tempfile
from typing import Optional, Sequence

from .. import net
from ..config import user_module_dirs
from ..config.schema import NPROC_WORDS
from ..errors import DdpxError, TrainingDiverged
from ..rank.launcher_contract import DONE_DIR_ENV, LAUNCHER_PID_ENV
from . import live, rendezvous
from .options import LaunchOptions, default_nproc, from_environment

WORKER_MODULE = "ddpx.worker"
SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"  # torchrun's agent: the signals it stops the workers on


def torchrun_argv(opts: LaunchOptions, launch_cfg, config_path: Optional[str], overrides: Sequence[str],
                  elastic=None) -> list[str]:
    """The torchrun command line (without the program name) for these options.

    Precedence: command-line option > torchrun's PET_* variables > SLURM > ``launch`` config section.
    Also checks ports and the rendezvous endpoint, and picks this node's network
    interface, before anything starts. ``elastic``: the config's ``elastic`` section; under
    ``recovery: live`` this node is a replica group of its own (:mod:`.live`).
    """
    if live.is_live(elastic):
        return _live_torchrun_argv(opts, launch_cfg, config_path, overrides, elastic)
    opts = from_environment(opts)
    nproc = nproc_per_node(opts, launch_cfg)
    nnodes = str(opts.nnodes if opts.nnodes is not None else launch_cfg["nnodes"])
    max_restarts = opts.max_restarts if opts.max_restarts is not None else launch_cfg["max_restarts"]
    argv = [f"--nproc-per-node={nproc}", f"--nnodes={nnodes}", f"--max-restarts={max_restarts}"]
    if opts.node_rank is not None:
        argv.append(f"--node-rank={opts.node_rank}")

    route = rendezvous.rendezvous_route(opts, nnodes)
    if route is not None:
        endpoint = f"{route.host}:{route.port}"
        backend = opts.rdzv_backend or ("c10d" if opts.rdzv_endpoint else "static")
        rdzv_id = opts.rdzv_id or rendezvous.DEFAULT_RDZV_ID
        argv += [f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}"]
        if backend == "c10d":
            is_host = rendezvous.check_rendezvous(route, rendezvous.rendezvous_wait_s())
            conf = rendezvous.rendezvous_conf(nnodes, is_host)
            if conf:
                argv.append("--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items()))
            if route.local_addr and not os.environ.get("PET_LOCAL_ADDR"):
                # The workers' MASTER_ADDR: otherwise the rank-0 agent's getfqdn(), often "localhost".
                argv.append(f"--local-addr={route.local_addr}")
        elif opts.node_rank is None:
            raise DdpxError(f"--rdzv-backend {backend} needs --node-rank or PET_NODE_RANK (0 on the node at {endpoint})")
        made = [] if route.one_machine else net.choose_socket_ifname(route.iface)
        if made:
            print(f"ddpx: {rendezvous.node_label(route)}: {' '.join(made)} (the interface that reaches "
                  f"{route.host}; set these variables yourself to choose another)", file=sys.stderr, flush=True)
        if backend == "c10d":  # torchrun says nothing while it waits, and a node that never comes costs minutes
            wait = conf.get("join_timeout", rendezvous.TORCH_JOIN_TIMEOUT_S)
            print(f"ddpx: {rendezvous.node_label(route)}: joining the rendezvous at {endpoint} (--nnodes {nnodes}; "
                  f"waiting up to {wait} s for the other nodes)", file=sys.stderr, flush=True)
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

    return _with_worker(argv, nproc, config_path, overrides)


def _live_torchrun_argv(opts: LaunchOptions, launch_cfg, config_path: Optional[str], overrides: Sequence[str],
                        elastic) -> list[str]:
    """:func:`torchrun_argv` under ``elastic.recovery: live``: a single-node job on a static
    rendezvous at this node's address towards the Lighthouse (:mod:`.live`)."""
    opts = live.live_options(opts)
    lighthouse = live.check_live_options(opts, launch_cfg, elastic)
    nproc = nproc_per_node(opts, launch_cfg)
    max_restarts = opts.max_restarts if opts.max_restarts is not None else launch_cfg["max_restarts"]
    argv = [f"--nproc-per-node={nproc}", *live.live_argv(opts, lighthouse, elastic), f"--max-restarts={max_restarts}"]
    return _with_worker(argv, nproc, config_path, overrides)


def _with_worker(argv: list[str], nproc, config_path: Optional[str], overrides: Sequence[str]) -> list[str]:
    """``argv`` and the worker to start, its config and overrides; the environment it inherits."""
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


def nproc_per_node(opts: LaunchOptions, launch_cfg) -> int:
    """Workers on this node: the option (after :func:`from_environment`), else
    ``launch.nproc_per_node``; auto, gpu or cpu as :func:`~.options.default_nproc` counts them."""
    nproc = opts.nproc_per_node if opts.nproc_per_node is not None else launch_cfg["nproc_per_node"]
    return default_nproc(nproc) if str(nproc) in NPROC_WORDS else int(nproc)


class WorkerCrashed(DdpxError):
    """A worker failed with something other than bad input (exit 1, as docs/checkpoints.md says)."""

    exit_code = 1


def run_torchrun(argv: Sequence[str]) -> int:
    from torch.distributed.run import parse_args, run

    args = parse_args(list(argv))
    with tempfile.TemporaryDirectory(prefix="ddpx-done-") as done_dir:
        env = {DONE_DIR_ENV: done_dir, LAUNCHER_PID_ENV: str(os.getpid()),  # inherited by the workers torchrun starts
               **agent_signals()}
        if args.rdzv_backend == "c10d" and SHARE_STORE_ENV not in os.environ:
            # A store per worker group, served by its rank 0 (see ddpx.rank.process_group): the agents'
            # shared store would keep the previous group's keys, namespaced by each agent's own
            # restart count, which differs between a survivor and a host that rejoined.
            env[SHARE_STORE_ENV] = "1"
        os.environ.update(env)
        try:
            with _quiet_agent():
                return _run_agent(run, args, done_dir)
        finally:
            for name in env:
                os.environ.pop(name, None)


def agent_signals() -> dict:
    """The variables that tell torchrun's agent which signals to take (and forward to the
    workers): its own default, SIGTERM, SIGINT, SIGHUP and SIGQUIT, except under ``nohup``
    (SIGHUP ignored), where the agent would otherwise take the SIGHUP of a closed terminal as a
    stop; ignored, it stays ignored in the workers too."""
    if SIGNALS_ENV in os.environ or signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:
        return {}
    return {SIGNALS_ENV: "SIGTERM,SIGINT,SIGQUIT"}


# torchrun's log lines that ddpx says in its own words (a failed or stopped rank, a signal).
AGENT_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api")
AGENT_NOISE = ("Received %s death signal", "Sending process %s closing signal", "failed (exitcode: %s)",
               "Got termination signal")


class _AgentNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(AGENT_NOISE))


@contextlib.contextmanager
def _quiet_agent():
    noise = _AgentNoise()
    loggers = [logging.getLogger(name) for name in AGENT_LOGGERS]
    for logger in loggers:
        logger.addFilter(noise)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(noise)


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
        stopped_by = _signal_name(code - 128) if code > 128 else None
        why = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        if _every_local_worker_finished(args, done_dir):
            # Every local worker finished training (process group destroyed, checkpoints
            # written) before one died while Python shut down: torch + gloo can abort
            # there ("terminate called without an active exception"). Nothing was lost.
            print(f"ddpx: warning: training finished; rank {rank} then {why} while exiting{more}", file=sys.stderr)
            return 0
        node = f"node {args.local_addr}: " if args.local_addr else ""
        if stopped_by is not None:  # a worker stopped by a signal that did not reach this launcher
            print(f"ddpx: {node}stopped: rank {rank} was stopped by {stopped_by}{more}", file=sys.stderr, flush=True)
            return code
        said = "; its error is printed above" if code > 0 else ""  # a killed worker printed nothing
        message = f"{node}training failed: rank {rank} (pid {failure.pid}) {why}{more}{said}"
        failed = DdpxError(message) if code == DdpxError.exit_code else WorkerCrashed(message)
        # A ddpx worker's own exit codes: the first failing rank of this node printed why (ddpx/worker.py).
        failed.shown = code in (WorkerCrashed.exit_code, DdpxError.exit_code)
        raise failed from None
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


def _signal_name(number: int) -> Optional[str]:
    try:
        return signal.Signals(number).name
    except ValueError:
        return None


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

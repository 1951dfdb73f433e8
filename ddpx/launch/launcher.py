"""``ddpx train``'s launcher: validate the config, check the run directory and the network,
record the launch, run torchrun; when training does not finish, say how to resume (or
remove the run directory the launch made, when nothing was saved there)."""

from __future__ import annotations

import os
import socket
from typing import Optional, Sequence

from ..config import default_run_dir, load_config
from ..console import CONSOLE_LOG, copied_to, survive_closed_console
from ..errors import DdpxError
from ..rank.run_lock import JOB_ENV
from .options import DEFAULT_MASTER_PORT, LaunchOptions, check_options, from_environment
from .preflight import check_run_dir, check_target_arguments, warn_if_oversubscribed
from .rendezvous import DEFAULT_RDZV_ID
from .resume import LaunchTrace, after_failure, record_launch
from .torchrun import nproc_per_node, run_torchrun, torchrun_argv


def launch(config_path: Optional[str], overrides: Sequence[str], opts: LaunchOptions) -> int:
    """Validate the config here (one-line errors, nothing spawned), then run torchrun.
    When training does not finish, the last line says how to resume, if there is a checkpoint
    to resume from."""
    survive_closed_console()  # `ddpx train | tee log` and Ctrl-C: tee dies first; the stop goes on
    config = load_config(config_path, overrides)  # raises DdpxError before any worker exists
    check_target_arguments(config)
    check_options(opts)
    run_dir = config.run_dir
    if run_dir is None:  # one for the whole launch: a restarted worker group resumes there
        run_dir = default_run_dir()
        overrides = [*overrides, f"run_dir={run_dir}"]
    given_job = os.environ.get(JOB_ENV)
    os.environ[JOB_ENV] = given_job or job_identity(opts)  # the run_dir lock's owner (ddpx/rank/run_lock.py)
    trace = None  # what run_dir held before the workers started
    try:
        check_run_dir(run_dir, config)
        # checks ports (and, under elastic.recovery=live, torchft and the Lighthouse); nothing created yet
        argv = torchrun_argv(opts, config.launch, config_path, overrides, config.elastic)
        warn_if_oversubscribed(nproc_per_node(from_environment(opts), config.launch), config.trainer)
        trace = LaunchTrace.before(run_dir, config)
        record_launch(run_dir, config_path, overrides)
        with copied_to(os.path.join(run_dir, CONSOLE_LOG)):  # the stop and resume lines, whatever the console
            try:
                code = run_torchrun(argv)
            except DdpxError as exc:
                after_failure(trace, config_path, overrides, bad_input=exc.exit_code == DdpxError.exit_code)
                raise
            if code != 0:
                after_failure(trace, config_path, overrides, bad_input=False)
    finally:
        if given_job is None:
            os.environ.pop(JOB_ENV, None)
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

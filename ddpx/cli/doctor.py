"""``ddpx doctor``: check the machine and network for distributed training."""

import argparse
import json
import os

from ..config import load_config, split_config_and_overrides
from ..errors import DdpxError
from ..launch import options, rendezvous
from ..launch.options import add_launch_arguments


def register(subparsers):
    p = subparsers.add_parser(
        "doctor",
        help="check backend, ports, addresses and interfaces before a distributed run",
        description="One line per check (OK / WARN / FAIL) with the fix. Exit code 1 when a check fails. "
                    "Takes `ddpx train`'s arguments: replace `train` with `doctor` in the command you are "
                    "about to run on each node.",
    )
    p.add_argument("config", nargs="?", default=None, help="the run's YAML config (its launch section counts)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    add_launch_arguments(p)
    p.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # a `ddpx train --smoke` line works as is
    p.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    p.add_argument("--collectives", action="store_true",
                   help="also start N local processes and run allreduce, barrier and every ddpx comm hook")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds allowed for --collectives")
    p.set_defaults(func=run)


def run(args):
    from .. import doctor  # torch: only when the command runs

    config_path, overrides = split_config_and_overrides(args.config, args.overrides)
    launch_cfg = load_config(config_path, overrides).launch
    opts = options.from_environment(options.options_from_args(args))  # PET_* and SLURM, as ddpx train
    nnodes = str(opts.nnodes if opts.nnodes is not None else launch_cfg["nnodes"])
    max_nodes = nnodes.rpartition(":")[2]
    if not max_nodes.isdigit() or int(max_nodes) < 1:
        raise DdpxError(f"--nnodes must be N or MIN:MAX with N >= 1, got {nnodes!r}")
    nproc = opts.nproc_per_node if opts.nproc_per_node is not None else launch_cfg["nproc_per_node"]
    nproc = int(nproc) if str(nproc).isdigit() else None  # "auto" (or torchrun's "gpu"): one per GPU
    route = rendezvous.rendezvous_route(opts, nnodes, wait_s=0)  # None on one node; a name that does not resolve: now
    if route is not None:
        addr, port = route.host, route.port
        backend = opts.rdzv_backend or ("c10d" if opts.rdzv_endpoint else "static")
    else:
        addr = opts.master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
        port, backend = opts.master_port, opts.rdzv_backend or "static"
    if port is None:
        raw = os.environ.get("MASTER_PORT", str(doctor.DEFAULT_MASTER_PORT))
        try:
            port = int(raw)
        except ValueError:
            raise DdpxError(f"MASTER_PORT={raw!r} is not a number; set it to a port such as 29500") from None
    facts = doctor.gather_facts(addr, port, nproc, nnodes=int(max_nodes), route=route, rdzv_backend=backend,
                                node_rank=opts.node_rank)
    checks = doctor.run_checks(facts)
    if args.collectives:
        checks += doctor.run_collectives(nproc or 2, timeout_s=args.timeout)
    if args.json:
        print(json.dumps(doctor.summarize(checks), indent=2))
    else:
        print(doctor.format_text(checks))
    return doctor.exit_code(checks)

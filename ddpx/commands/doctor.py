"""``ddpx doctor``: check the machine and network for distributed training."""

import json
import os

from ..errors import DdpxError


def register(subparsers):
    p = subparsers.add_parser(
        "doctor",
        help="check backend, ports, addresses and interfaces before a distributed run",
        description="One line per check (OK / WARN / FAIL) with the fix. Exit code 1 when a check fails.",
    )
    p.add_argument("--master-addr", default=None,
                   help="the rendezvous host (default: inside srun the job's first node, else $MASTER_ADDR "
                        "or 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=None,
                   help="the rendezvous port (default: inside srun the one ddpx train derives, else "
                        "$MASTER_PORT or 29500)")
    p.add_argument("--nproc-per-node", type=int, default=None, help="processes per node you plan to start")
    p.add_argument("--nnodes", type=int, default=None,
                   help="nodes you plan to use (default: inside srun the job's, else 1); with several, "
                        "a loopback-only setup is a failure")
    p.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    p.add_argument("--collectives", action="store_true",
                   help="also start N local processes and run allreduce, barrier and every ddpx comm hook")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds allowed for --collectives")
    p.set_defaults(func=run)


def run(args):
    from .. import doctor, slurm

    port, addr, nproc, nnodes = args.master_port, args.master_addr, args.nproc_per_node, args.nnodes
    if slurm.in_slurm_step():  # check what `srun ddpx train` will use
        job = slurm.launch_from_slurm()
        addr = addr or job.master_addr
        port = port if port is not None else job.master_port
        nproc = nproc if nproc is not None else job.nproc_per_node
        nnodes = nnodes if nnodes is not None else job.nnodes
    addr = addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    if port is None:
        raw = os.environ.get("MASTER_PORT", str(doctor.DEFAULT_MASTER_PORT))
        try:
            port = int(raw)
        except ValueError:
            raise DdpxError(f"MASTER_PORT={raw!r} is not a number; set it to a port such as 29500") from None
    if nnodes is not None and nnodes < 1:
        raise DdpxError(f"--nnodes must be at least 1, got {nnodes}")
    facts = doctor.gather_facts(addr, port, nproc, nnodes=nnodes or 1)
    checks = doctor.run_checks(facts)
    if args.collectives:
        checks += doctor.run_collectives(nproc or 2, timeout_s=args.timeout)
    if args.json:
        print(json.dumps(doctor.summarize(checks), indent=2))
    else:
        print(doctor.format_text(checks))
    return doctor.exit_code(checks)

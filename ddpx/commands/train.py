"""``ddpx train [CONFIG] [KEY=VALUE ...]``: train through torchrun."""

from ..errors import DdpxError


def register(subparsers):
    p = subparsers.add_parser(
        "train",
        help="train from a YAML config (default: the built-in digits example) through torchrun",
        description=(
            "Validate the config, then start one worker per process through torchrun "
            "(torch.distributed.run). KEY=VALUE arguments override config keys, e.g. "
            "trainer.epochs=3 optimizer.args.lr=0.05 (values are YAML scalars)."
        ),
    )
    p.add_argument("config", nargs="?", default=None,
                   help="YAML config file (omit for the built-in digits run; KEY=VALUE may follow directly)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    p.add_argument("--nproc-per-node", default=None,
                   help="workers on this node (default: launch.nproc_per_node = auto: one per GPU, 2 on CPU)")
    p.add_argument("--nnodes", default=None, help="number of nodes, or MIN:MAX for elastic runs (default: launch.nnodes)")
    p.add_argument("--node-rank", type=int, default=None, help="rank of this node (static rendezvous)")
    p.add_argument("--rdzv-backend", default=None, help="rendezvous backend (default: c10d with several nodes, static with one)")
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous (node 0's address) for multi-node runs")
    p.add_argument("--rdzv-id", default=None, help="rendezvous id, the same on every node (default: ddpx)")
    p.add_argument("--max-restarts", type=int, default=None, help="worker-group restarts after a failure (default: launch.max_restarts)")
    p.add_argument("--master-addr", default=None, help="address of the single-node store (default: 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=None, help="port of the single-node store (default: a free port)")
    p.add_argument("--smoke", action="store_true",
                   help="smoke run: a few steps, one evaluation, a checkpoint save and resume on a small data "
                        "slice with every configured plugin; prints a PASS/FAIL table (ddpx/smoke.py)")
    p.set_defaults(func=run)


def split_config_and_overrides(config, overrides):
    """``ddpx train trainer.epochs=3`` means: default config, one override."""
    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        return None, [config, *overrides]
    for item in overrides:
        if "=" not in item:
            raise DdpxError(f"unexpected argument '{item}': after the config file only KEY=VALUE overrides may follow")
    return config, list(overrides)


def run(args):
    from ..launch import LaunchOptions, launch

    config, overrides = split_config_and_overrides(args.config, args.overrides)
    opts = LaunchOptions(
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_backend=args.rdzv_backend,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        max_restarts=args.max_restarts,
        master_addr=args.master_addr,
        master_port=args.master_port,
    )
    if args.smoke:
        from ..smoke import launch_smoke

        return launch_smoke(config, overrides, opts)
    return launch(config, overrides, opts)

"""``ddpx train [CONFIG] [KEY=VALUE ...]``: train through torchrun."""

import os
import sys

from ..config import split_config_and_overrides
from ..errors import DdpxError
from ..launch.launcher import launch
from ..launch.options import add_launch_arguments, check_options, live_overrides, options_from_args
from ..launch.resume import newest_run


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
    add_launch_arguments(p, live=True)
    p.add_argument("--smoke", action="store_true",
                   help="smoke run: a few steps, one evaluation, a checkpoint save and resume on a small data "
                        "slice with every configured plugin; prints a PASS/FAIL table (ddpx/smoke/)")
    p.add_argument("--resume", nargs="?", const="newest", default=None, metavar="RUN_DIR",
                   help="resume a run: the newest one started with this config under runs/, or RUN_DIR")
    p.set_defaults(func=run, overrides_anywhere=True)  # KEY=VALUE also after the options (ddpx/cli/__init__.py)


def run(args):
    config, overrides = split_config_and_overrides(args.config, args.overrides)
    opts = options_from_args(args)
    check_options(opts)
    overrides = [*overrides, *live_overrides(opts)]  # --lighthouse: elastic.recovery=live, elastic.lighthouse
    if args.resume is not None:
        if "=" in args.resume:  # `--resume KEY=VALUE`: argparse took the override for RUN_DIR
            overrides, args.resume = [*overrides, args.resume], "newest"
        run_dir = newest_run(config) if args.resume == "newest" else args.resume
        if not os.path.isdir(run_dir):
            raise DdpxError(f"--resume {run_dir}: no such run directory; pass a run_dir of an earlier run, "
                            "or --resume alone for the newest run of this config")
        print(f"ddpx: resuming {run_dir}", file=sys.stderr, flush=True)
        overrides = [*overrides, f"run_dir={run_dir}"]
    if args.smoke:
        from ..smoke.report import launch_smoke  # torch: only for a smoke run

        return launch_smoke(config, overrides, opts)
    return launch(config, overrides, opts)

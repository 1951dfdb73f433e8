"""The ``ddpx`` command line: ``ddpx train``, ``ddpx doctor``, ``ddpx plugins``, ``ddpx bench``, ``ddpx lighthouse``.

One module per subcommand in this package. Each defines ``register(subparsers)``, which
adds its parser and sets ``func`` (called with the parsed args; returns the exit code).
:func:`build_parser` finds them here, so adding a command is adding a file.
"""

import argparse
import importlib
import os
import pkgutil
import sys

from ..collector import freeze_what_is_alive
from ..errors import DdpxError
from ..version import __version__


def build_parser():
    parser = argparse.ArgumentParser(
        prog="ddpx", description="Plugin-based PyTorch DDP training (runs through torchrun)."
    )
    parser.add_argument("--version", action="version", version=f"ddpx {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        module.register(sub)
    return parser


def main(argv=None):
    try:
        return _main(argv)
    finally:
        if argv is None:  # the ddpx command itself, not a caller in its own process
            freeze_what_is_alive()


def _main(argv):
    # Before torch loads (it reads this once): c10d's C++ warnings when a peer or store goes
    # away carry a C++ stack trace each, while ddpx names the failure in one line.
    # TORCH_CPP_LOG_LEVEL=WARNING shows them again.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # `ddpx train cfg.yaml --nproc-per-node 1 trainer.epochs=3`: argparse stops collecting
        # positionals at the first option; overrides may come anywhere.
        if getattr(args, "overrides_anywhere", False) and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.parse_args(argv)  # argparse's own one-line error for what it does not know
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except DdpxError as exc:
        if not exc.shown:
            print(f"ddpx: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("ddpx: interrupted", file=sys.stderr)
        return 130


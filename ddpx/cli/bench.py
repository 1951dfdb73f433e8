"""``ddpx bench <name>``: one subcommand per module in :mod:`ddpx.bench` that defines ``register``."""

import importlib
import pkgutil

from .. import bench as bench_pkg


def register(subparsers):
    parser = subparsers.add_parser("bench", help="micro-benchmarks (kernels, communication, ...)")
    sub = parser.add_subparsers(dest="bench", metavar="BENCHMARK")
    for info in sorted(pkgutil.iter_modules(bench_pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):  # a helper, no benchmark (_reference imports torch: not for --help)
            continue
        module = importlib.import_module(f"{bench_pkg.__name__}.{info.name}")
        if hasattr(module, "register"):
            module.register(sub)
    parser.set_defaults(func=lambda args: _missing(parser))


def _missing(parser):
    parser.print_help()
    return 2

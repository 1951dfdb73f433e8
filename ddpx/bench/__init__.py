"""Benchmarks behind ``ddpx bench``.

Each module here that defines ``register(subparsers)`` adds one ``ddpx bench``
subcommand (``kernels.py`` -> ``ddpx bench kernels``); ``ddpx/cli/bench.py``
discovers them, so a new benchmark is a new module. The scripts in
``benchmarks/`` call the same code.
"""

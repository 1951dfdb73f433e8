"""Benchmarks behind ``ddpx bench``.

Each module here that defines ``register(subparsers)`` adds one ``ddpx bench``
subcommand (``kernels.py`` -> ``ddpx bench kernels``); ``ddpx/cli/bench.py``
discovers them (a private ``_module`` is a helper and not imported there), so a new
benchmark is a new module; it imports torch inside its functions, so ``ddpx --help`` does
not. The scripts in
``benchmarks/`` call the same code.
"""

"""Subcommands of the ``ddpx`` CLI, one module each.

Every module here defines ``register(subparsers)``, which adds its parser and
sets ``func`` (called with the parsed args; returns the exit code). ``ddpx.cli``
discovers the modules automatically, so adding a command is adding a file.
"""

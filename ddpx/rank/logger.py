"""The ``ddpx`` logger of a run: a default rank-prefixed handler, and the settings a
run restores when it ends (a later run or test in the same process sees its own)."""

from __future__ import annotations

import logging
import sys


def logger_settings(log: logging.Logger) -> tuple:
    return list(log.handlers), log.level, log.propagate


def restore_logger(log: logging.Logger, settings: tuple) -> None:
    handlers, level, propagate = settings
    for handler in list(log.handlers):
        if handler not in handlers:
            log.removeHandler(handler)
            handler.close()  # a file handler's file (the run's console.log)
    for handler in handlers:
        if handler not in log.handlers:
            log.addHandler(handler)
    log.setLevel(level)
    log.propagate = propagate


def default_log_handler(log: logging.Logger, rank: int) -> None:
    """A ``[rankN]`` stderr handler, rank 0 INFO only, for when no plugin configured the logger."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[rank{rank}] %(message)s"))
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)

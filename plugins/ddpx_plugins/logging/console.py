"""The ``ddpx`` logger (``trainer.log``) on every rank: a rank prefix on each message
(``[rank1] ...``); only rank 0's messages at ``logging.level`` and above unless
``logging.all_ranks`` (warnings and errors of every rank always); written through
``tqdm.write`` so they do not tear the bar, and appended to ``<run_dir>/console.log``."""

import logging
import sys

from ddpx.console import CONSOLE_LOG
from ddpx.plugin.manager import rank_prefix

LOGGER = "ddpx"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}


class _RankFilter(logging.Filter):
    """Adds the rank prefix; drops other ranks' info/debug messages unless all ranks are wanted."""

    def __init__(self, rank, all_ranks):
        super().__init__()
        self.rank = rank
        self.all_ranks = all_ranks
        self.prefix = rank_prefix()

    def filter(self, record):
        record.rank_prefix = self.prefix
        return self.all_ranks or self.rank == 0 or record.levelno >= logging.WARNING


class _TqdmHandler(logging.Handler):
    """Writes through ``tqdm.write`` so messages do not tear the progress bar."""

    def emit(self, record):
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


class _RunLogHandler(logging.FileHandler):
    """The same lines in the run directory's console.log (opened at the first one)."""


def configure_logger(rank, all_ranks, level=logging.INFO, run_dir=None):
    """Route the ``ddpx`` logger through one rank-aware handler, and one appending to
    ``run_dir``'s console.log (replacing earlier ones)."""
    logger = logging.getLogger(LOGGER)
    for handler in list(logger.handlers):
        if isinstance(handler, (_TqdmHandler, _RunLogHandler)):
            logger.removeHandler(handler)
            handler.close()
    handlers = [_TqdmHandler()]
    if run_dir is not None:
        handlers.append(_RunLogHandler(run_dir / CONSOLE_LOG, encoding="utf-8", delay=True))
    rank_filter = _RankFilter(rank, all_ranks)
    for handler in handlers:
        handler.addFilter(rank_filter)
        handler.setFormatter(logging.Formatter("%(rank_prefix)s%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # one line per message, even if the root logger has handlers
    return logger

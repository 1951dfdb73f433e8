"""The one exception type for user-facing errors.

Raise ``DdpxError("what is wrong; how to fix it")`` for bad input (config, files,
ports, options). The CLI prints it as one line and exits non-zero, never with a
traceback. Keep the message to one line naming the key/file/port and the fix.
"""

import difflib
import os
from typing import Iterable

# Set (to anything but 0) to see the full traceback of an error ddpx prints as one line.
TRACEBACK_ENV = "DDPX_TRACEBACK"


def show_tracebacks() -> bool:
    return os.environ.get(TRACEBACK_ENV, "") not in ("", "0")


class DdpxError(Exception):
    """A problem the user can fix; printed as one line by the CLI."""

    exit_code = 2
    same_on_every_rank = False  # True: every rank raises it with the same message (printed once per node)
    shown = False  # True: a worker printed the message already; the CLI only exits with exit_code


class RanksDisagree(DdpxError):
    """Ranks that must agree do not (their models, their collectives): found on every rank at
    once, with the same message, which rank 0 of each node prints."""

    same_on_every_rank = True


class TrainingDiverged(DdpxError):
    """The loss or the weights went non-finite under ``trainer.nonfinite: stop``:
    raised on every rank at the same boundary; workers and ``ddpx train`` exit
    with 3, distinct from a config error (2), a crash (1) and a signal (128+N)."""

    exit_code = 3
    same_on_every_rank = True


def did_you_mean(name: str, options: Iterable[str], prefix: str = "") -> str:
    """``"; did you mean 'PREFIX+closest'?"`` for an error message, or "" when nothing is close."""
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f"; did you mean '{prefix}{close[0]}'?" if close else ""

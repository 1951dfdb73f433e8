"""Where a run writes (``run_dir``) and where it imports the user's own modules from."""

from __future__ import annotations

import datetime
import os
import sys
from typing import Optional

from ..imports import USER_DIRS


def default_run_dir() -> str:
    """``runs/<UTC timestamp>`` under the current directory, absolute. ``ddpx train``
    picks it once per launch, so torchrun's restarts resume in the same place."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return os.path.abspath(os.path.join("runs", stamp))


def user_module_dirs(config_path: Optional[str]) -> list[str]:
    """Where a run finds the user's own modules (``model.target: mymodel.Net``), first
    first: the config file's directory, then the current directory (which
    ``python -m`` puts first too). Both come before ``PYTHONPATH`` and the
    installed packages."""
    dirs = [os.path.dirname(os.path.abspath(config_path))] if config_path is not None else []
    return list(dict.fromkeys([*dirs, os.getcwd()]))


def add_user_module_dirs(config_path: Optional[str]) -> None:
    """Put :func:`user_module_dirs` at the front of ``sys.path`` (once), and note them for
    "no module named" errors (:data:`ddpx.imports.USER_DIRS`)."""
    dirs = user_module_dirs(config_path)
    USER_DIRS.clear()
    for directory in dirs:
        what = "the config file's directory" if config_path is not None and directory == dirs[0] else ""
        if directory == os.getcwd():
            what = f"{what} and the current directory" if what else "the current directory"
        USER_DIRS[directory] = what
    for directory in reversed(dirs):
        if directory not in sys.path:
            sys.path.insert(0, directory)

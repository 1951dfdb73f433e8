"""What a launch records in its run directory, and the ``ddpx train`` command that resumes it."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from ..config import default_run_dir
from ..errors import DdpxError

LAUNCH_RECORD = "ddpx-launch.json"  # in run_dir: the config and overrides that started it (for --resume)


def resume_command(config_path: Optional[str], overrides: Sequence[str], run_dir: str) -> str:
    kept = [o for o in overrides if not o.startswith("run_dir=")]
    words = ["ddpx", "train", *([config_path] if config_path else []), *kept, f"run_dir={run_dir}"]
    return " ".join(shlex.quote(str(w)) for w in words)


def print_resume_command(config_path, overrides, run_dir) -> None:
    print(f"ddpx: to resume this run: {resume_command(config_path, overrides, run_dir)}", file=sys.stderr,
          flush=True)


def record_launch(run_dir: str, config_path: Optional[str], overrides: Sequence[str]) -> None:
    record = {"config": os.path.abspath(config_path) if config_path else None,
              "overrides": [o for o in overrides if not o.startswith("run_dir=")], "started": time.time()}
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        Path(run_dir, LAUNCH_RECORD).write_text(json.dumps(record))
    except OSError:
        pass  # check_run_dir found it writable; a vanishing directory shows up in the workers


def newest_run(config_path: Optional[str], runs: Optional[str] = None) -> str:
    """``ddpx train CONFIG --resume``: the newest run directory under ``runs/`` (where
    runs without ``run_dir`` go) that was started with this config file."""
    wanted = os.path.abspath(config_path) if config_path else None
    base = Path(runs or os.path.dirname(default_run_dir()))
    found = []
    for record in base.glob(f"*/{LAUNCH_RECORD}"):
        try:
            data = json.loads(record.read_text())
        except (OSError, ValueError):
            continue
        if data.get("config") == wanted:
            found.append((float(data.get("started", 0)), str(record.parent)))
    if not found:
        raise DdpxError(f"--resume: no run of {config_path or 'the built-in config'} under {base}; "
                        "pass the run directory: --resume RUN_DIR (or run_dir=RUN_DIR)")
    return max(found)[1]

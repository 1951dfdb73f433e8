"""What a launch records in its run directory, the ``ddpx train`` command that resumes it,
and what a failed launch leaves behind."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ..config import default_run_dir
from ..console import CONSOLE_LOG
from ..errors import DdpxError

LAUNCH_RECORD = "ddpx-launch.json"  # in run_dir: the config and overrides that started it (for --resume)


def resume_command(config_path: Optional[str], overrides: Sequence[str], run_dir: str) -> str:
    kept = [o for o in overrides if not o.startswith("run_dir=")]
    words = ["ddpx", "train", *([config_path] if config_path else []), *kept, f"run_dir={run_dir}"]
    return " ".join(shlex.quote(str(w)) for w in words)


def resume_line(config_path: Optional[str], overrides: Sequence[str], run_dir: str) -> str:
    return f"ddpx: to resume this run: {resume_command(config_path, overrides, run_dir)}"


def print_resume_command(config_path, overrides, run_dir) -> None:
    print(resume_line(config_path, overrides, run_dir), file=sys.stderr, flush=True)


@dataclass
class LaunchTrace:
    """What the run directory held before the workers started."""

    run_dir: str
    checkpoint_dir: Path
    made: list  # the directories this launch creates (run_dir and the parents it lacks), innermost first
    checkpoints: list  # (step, path) of the checkpoints already there

    @classmethod
    def before(cls, run_dir: str, config) -> "LaunchTrace":
        path = Path(run_dir).absolute()
        made = [p for p in (path, *path.parents) if not p.exists()]
        directory = Path(config.section("checkpoint").get("dir") or "checkpoints")
        directory = directory if directory.is_absolute() else path / directory
        return cls(run_dir, directory, made, saved_checkpoints(directory))


def saved_checkpoints(directory: Path) -> list:
    from ..rank.checkpoint_files import CheckpointDirectory

    try:
        return CheckpointDirectory(directory).checkpoints()
    except OSError:
        return []


def after_failure(trace: LaunchTrace, config_path: Optional[str], overrides: Sequence[str], bad_input: bool) -> None:
    """The resume command, when there is a checkpoint to resume from (not after bad input that
    saved nothing new: the same command would fail the same way); otherwise remove what the
    launch made if nothing was saved in it."""
    now = saved_checkpoints(trace.checkpoint_dir)
    if now and not (bad_input and now == trace.checkpoints):
        print_resume_command(config_path, overrides, trace.run_dir)
    elif trace.made:
        remove_unused(trace.made)


def remove_unused(made: Sequence[Path]) -> None:
    """Remove the launch record, the console's copy, empty files and empty directories from the
    directories a failed launch made, innermost first; a file with anything else in it keeps its
    directory."""
    run_dir = made[0]
    (run_dir / LAUNCH_RECORD).unlink(missing_ok=True)
    (run_dir / CONSOLE_LOG).unlink(missing_ok=True)
    for path in sorted(run_dir.rglob("*"), reverse=True):
        if path.is_dir() and not path.is_symlink():
            _rmdir_if_empty(path)
        elif path.is_file() and not path.is_symlink() and path.stat().st_size == 0:
            path.unlink()
    for directory in made:
        if not _rmdir_if_empty(directory):
            break


def _rmdir_if_empty(directory: Path) -> bool:
    try:
        directory.rmdir()  # only an empty directory
        return True
    except OSError:
        return False


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

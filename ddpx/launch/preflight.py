"""Checks of the run directory before any worker starts: writable, not held by another
run, room for a checkpoint."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

from ..errors import DdpxError
from ..imports import instantiate
from ..rank.run_lock import job_id, read_holder, refusal, stale_reason


def model_bytes(config) -> Optional[int]:
    """The model's parameter bytes, built on the meta device (no memory, no data); None
    when the model cannot be built there."""
    import torch

    try:
        with torch.device("meta"):
            model = instantiate(config.model, "model")
        return sum(p.numel() * p.element_size() for p in model.parameters())
    except Exception:
        return None


def check_run_dir(run_dir: str, config) -> None:
    """Before any worker starts: ``run_dir`` can be created and written (its nearest existing
    directory is writable: nothing is created here), no other run
    holds it (ddpx/rank/run_lock.py), and its file system has room for about one checkpoint
    (weights plus optimizer state, counted as 3x the parameters)."""
    path = Path(run_dir).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())  # nothing is created here
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        why = "not a directory" if not existing.is_dir() else "no write permission or a read-only file system"
        raise DdpxError(f"run_dir {run_dir} is not writable ({existing}: {why}); choose another with run_dir=DIR")
    holder = read_holder(path)
    if holder and holder.get("job") != job_id() and stale_reason(holder) is None:
        raise DdpxError(refusal(path, holder))
    params = model_bytes(config)
    if params:
        needed, free = 3 * params, shutil.disk_usage(existing).free
        if free < needed:
            raise DdpxError(f"run_dir {run_dir} has {free / 2**20:.0f} MB free, a checkpoint needs about "
                            f"{needed / 2**20:.0f} MB; free some space or choose another run_dir")

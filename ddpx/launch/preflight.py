"""Checks before any worker starts: the run directory (writable, not held by another run,
room for a checkpoint), the config targets' arguments (names their signatures take), and a
warning when the workers oversubscribe this node."""

from __future__ import annotations

import inspect
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

from ..errors import DdpxError, did_you_mean
from ..imports import instantiate, resolve
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


def oversubscription(nproc: int, trainer_cfg, cores: Optional[int] = None, gpus: Optional[int] = None,
                     threads: Optional[str] = None) -> Optional[str]:
    """Why ``nproc`` workers on this node oversubscribe it, with the fix, or None. DDP's
    collectives wait for the slowest rank at every step, so a worker that waits for a core
    (more workers x threads than cores) or a GPU (more workers than GPUs) slows them all.
    ``cores``, ``gpus``, ``threads`` (``OMP_NUM_THREADS``): this machine's unless given. The
    device is chosen as ddpx.rank.process_group does: with ``auto``, the GPUs only when
    every worker has its own."""
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device, backend = trainer_cfg.device, trainer_cfg.backend
    on_gpu = str(device).startswith("cuda") or (
        device == "auto" and (backend == "nccl" or (backend == "auto" and 0 < nproc <= gpus)))
    if on_gpu and nproc > gpus:
        return (f"{nproc} workers share {gpus} GPU{'s' if gpus != 1 else ''}: ranks on one GPU take turns and every "
                f"collective waits for them; use --nproc-per-node {gpus}")
    if not on_gpu and device == "auto" and backend == "auto" and 0 < gpus < nproc:
        return (f"{nproc} workers but {gpus} GPU{'s' if gpus != 1 else ''}: trainer.device=auto trains on the CPU "
                f"(gloo) unless every worker has its own GPU; use --nproc-per-node {gpus} to train on the GPUs")
    if on_gpu or nproc == 1:  # one worker has no collective to hold up
        return None
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = os.environ.get("OMP_NUM_THREADS") if threads is None else threads
    per_worker = int(threads) if threads and threads.strip().isdigit() and int(threads) > 0 else cores
    if nproc * per_worker <= cores:
        return None
    if nproc > cores:
        fix = f"use --nproc-per-node {cores} (or fewer)"
    else:
        fix = f"set OMP_NUM_THREADS={cores // nproc}"
    return (f"{nproc} workers x {per_worker} thread{'s' if per_worker != 1 else ''} (OMP_NUM_THREADS) on {cores} "
            f"CPU core{'s' if cores != 1 else ''}: oversubscribed, every collective waits for a worker without a core; "
            f"{fix}")


def warn_if_oversubscribed(nproc: int, trainer_cfg) -> None:
    """One warning line at launch (not an error: a small trial may be worth it)."""
    why = oversubscription(nproc, trainer_cfg)
    if why is not None:
        print(f"ddpx: warning: {why}", file=sys.stderr, flush=True)


# What the trainer passes before a target's config args (ddpx/train/trainer.py): the model's
# parameters to the optimizer, the optimizer to the scheduler.
TRAINER_POSITIONALS = {"model": 0, "data": 0, "loss": 0, "optimizer": 1, "scheduler": 1}


def check_target_arguments(config) -> None:
    """Before any worker starts: every ``<section>.args`` key of a target section is an argument
    its target takes (``optimizer.args.lrr``: did you mean 'lr'?), and no argument the target
    needs is missing. A target taking ``**kwargs`` accepts any name; one whose signature
    Python cannot read is left to the workers."""
    for section, passed in TRAINER_POSITIONALS.items():
        target = (config.get(section) or {}).get("target")
        if not target:
            continue
        factory = resolve(target, f"{section}.target")
        try:
            params = list(inspect.signature(factory).parameters.values())
        except (TypeError, ValueError):
            continue
        args = dict(config[section].get("args") or {})
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:passed]
        named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p not in positional]
        any_name = any(p.kind is p.VAR_KEYWORD for p in params)
        for name in args:
            if name in (p.name for p in positional):
                raise DdpxError(f"{section}.args.{name}: the trainer passes '{name}' to {target} itself; "
                                f"remove {section}.args.{name}")
            if name not in named and not any_name:
                hint = did_you_mean(name, named, f"{section}.args.") or \
                    (f"; it takes {', '.join(named)}" if named else "; it takes no arguments")
                raise DdpxError(f"{section}.args.{name}: {target} has no argument '{name}'{hint}")
        missing = [p.name for p in params if p not in positional and p.default is p.empty
                   and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in args]
        if missing:
            raise DdpxError(f"{section}: {target} needs the argument{'s' if len(missing) > 1 else ''} "
                            f"{', '.join(missing)}; set {section}.args.{missing[0]}=VALUE")

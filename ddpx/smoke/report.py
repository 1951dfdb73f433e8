"""The launcher side of the smoke run: start the ranks like a real run, collect their
records, print one PASS/FAIL/SKIP table."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import time
from pathlib import Path
from typing import Optional, Sequence

from ..errors import DdpxError
from ..launch import torchrun
from ..plugin.manager import origin
from ..launch.preflight import check_target_arguments
from .rank import FAIL, PASS, SKIP, SMOKE_MODULE, STAGES, TRACEBACK_SUFFIX, load_smoke_config


def smoke_run_dir(config, env=os.environ) -> str:
    """``<run_dir or runs>/smoke-<SLURM job id or UTC time>``: the same on every node of a SLURM job."""
    base = config.run_dir or "runs"
    tag = env.get("SLURM_JOB_ID") or datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return os.path.abspath(os.path.join(base, f"smoke-{tag}"))


def collect(run_dir: str) -> tuple[list[dict], int]:
    """Every rank's results and the world size (from rank 0's file, else the highest seen)."""
    results = []
    for path in sorted(Path(run_dir, "smoke").glob("rank*.json")):
        try:
            results.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    world = max((r["world_size"] for r in results), default=0)
    return sorted(results, key=lambda r: r["rank"]), world


def summarize(results: Sequence[dict], world_size: int) -> list[dict]:
    """One row per stage over all ranks: FAIL if any rank failed it or has no result."""
    by_rank = {r["rank"]: {s["stage"]: s for s in r["stages"]} for r in results}
    rows = []
    for stage in STAGES:
        entries = {rank: stages.get(stage) for rank, stages in by_rank.items()}
        failed = [(rank, e) for rank, e in sorted(entries.items()) if e and e["status"] == FAIL]
        missing = [rank for rank in range(world_size) if not entries.get(rank)]
        seconds = max((e["seconds"] for e in entries.values() if e), default=0.0)
        if failed:
            rank, entry = failed[0]
            ranks = ", ".join(str(r) for r, _ in failed)
            row = {"stage": stage, "status": FAIL, "detail": f"rank {ranks}: {entry['detail']}",
                   "plugin": entry.get("plugin"), "hook": entry.get("hook")}
        elif missing:
            row = {"stage": stage, "status": FAIL,
                   "detail": f"no result from rank {', '.join(map(str, missing))} (crashed or killed)"}
        else:
            first = entries.get(0) or next(iter(entries.values()))
            status = SKIP if all(e["status"] == SKIP for e in entries.values()) else PASS
            row = {"stage": stage, "status": status, "detail": first["detail"]}
        row["seconds"] = seconds
        rows.append(row)
    return rows


def format_table(rows: Sequence[dict], world_size: int, run_dir: str) -> str:
    width = max(len(s) for s in STAGES)
    lines = [f"smoke run: {world_size} rank(s), run dir {run_dir}",
             f"{'STAGE':<{width}}  STATUS  {'TIME':>7}  DETAIL"]
    for row in rows:
        lines.append(f"{row['stage']:<{width}}  {row['status']:<6}  {row['seconds']:>6.2f}s  {row['detail']}")
    failed = [row for row in rows if row["status"] == FAIL]
    if failed:
        named = [row for row in failed if row.get("plugin")]
        culprit = f": plugin '{named[0]['plugin']}' ({named[0]['hook']})" if named else ""
        tracebacks = sorted(Path(run_dir, "smoke").glob(f"rank*{TRACEBACK_SUFFIX}"))
        where = f"; tracebacks: {Path(run_dir, 'smoke', 'rank*' + TRACEBACK_SUFFIX)}" if tracebacks else ""
        lines.append(f"smoke run FAILED at {failed[0]['stage']}{culprit}{where}")
    else:
        lines.append("smoke run PASSED")
    return "\n".join(lines)


def launch_smoke(config_path: Optional[str], overrides: Sequence[str], opts) -> int:
    """``ddpx train --smoke``: launch the smoke ranks like a real run, then print the table."""
    try:  # validate here first: one-line errors before anything starts
        config = load_smoke_config(config_path, overrides, [])
    except Exception as exc:
        where = origin(exc)
        if where is None:
            raise
        raise DdpxError(f"smoke run FAILED at config: plugin '{where[0]}' raised in {where[1]}: "
                        f"{type(exc).__name__}: {exc}") from None
    check_target_arguments(config)
    run_dir = smoke_run_dir(config)
    overrides = [*overrides, f"run_dir={run_dir}"]
    # no restarts: a failing stage must be reported, not retried
    argv = torchrun.torchrun_argv(dataclasses.replace(opts, max_restarts=0), config.launch, config_path, overrides,
                                  config.elastic)
    module_at = argv.index("--module") + 1
    argv[module_at] = SMOKE_MODULE
    start = time.perf_counter()
    launch_error = None
    try:
        torchrun.run_torchrun(argv)
    except DdpxError as exc:
        launch_error = exc
    results, world = collect(run_dir)
    if not results:
        raise DdpxError(f"the smoke run produced no results in {run_dir}"
                        + (f" ({launch_error})" if launch_error else ""))
    rows = summarize(results, world)
    print(format_table(rows, world, run_dir))
    print(f"total {time.perf_counter() - start:.1f} s")
    failed = any(row["status"] == FAIL for row in rows) or launch_error is not None
    return 1 if failed else 0



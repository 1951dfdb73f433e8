"""Pipeline parallelism on the char GPT example: step time and each stage's idle time per
schedule and micro-batch count, against ddp on the same ranks; and what each rank holds of
parameters and AdamW state, as a fraction of ddp's. Every cell is one ``ddpx train`` (the
user's path) on this machine's gloo ranks.

Timing (``--sections timing``): the example (examples/char_gpt/config.yaml) with ``--layers``
blocks (8: a step takes long enough to time), fp32 (``amp.enabled=false``), no dropout,
AdamW, no accumulation, no evaluation, no checkpoint, ``--batch`` sequences of 64 characters
per step (per pipeline; ddp: ``--batch / --ranks`` per rank, the same global batch), on
``--ranks`` ranks of ``--threads`` torch threads each. Cells: ``ddp`` (the reference), and
``trainer.strategy=pipeline`` with ``pipeline.stages=--ranks`` for every schedule
(``--schedules``: 1f1b, gpipe, interleaved_1f1b with ``pipeline.stages_per_rank=2``) and
micro-batch count (``--microbatches``). Per cell, from the ``stage_timing`` plugin
(benchmarks/stage_timing.py) on every rank, the medians over the ``--steps`` steps after
``--warmup``, and over the rounds (``--rounds``, every cell once per round):

* ``ms_per_step``: between optimizer steps (rank 0), ``vs_ddp``: over ddp's in the same
  round (the median ratio), ``sequences_per_s``;
* per stage (rank): ``idle``: the fraction of ``Strategy.forward_backward``'s wall time that
  is not the stage's own compute (``forward_one_chunk``, ``backward_one_chunk``,
  ``backward_weight_one_chunk`` of torch.distributed.pipelining's stages): waiting for the
  previous stage's activation or the next stage's gradient, and, after the schedule, for
  the other stages to finish (the loss broadcast and the sum of the non-block gradients
  over the stages, which a stage that finished first waits in); split into ``p2p``: blocked
  in the schedule's point-to-point waits, ``sync``: after the schedule (those two
  collectives, their own transfer included), ``other``: the rest (the schedule's own
  bookkeeping, splitting the batch);
* ``on_cpu``: the ranks' main-thread CPU time (``time.thread_time``) over ``forward_backward``'s
  wall time, and per stage ``preempted``: the share of it the stage was computing by the
  wall clock but not on a core (other processes had it): on a busy machine both say how
  much of the step is the machine's, not the pipeline's;
* ``ideal_bubble``: the schedule's idle fraction with equal stages and free transfers,
  the same for every stage: (p-1)/(m+p-1) for 1F1B and GPipe
  (p stages, m micro-batches), (p-1)/(v m+p-1) interleaved (p ranks, v stages per rank);
  ``idle - ideal_bubble`` is what the stages' imbalance (the first stage holds the
  embeddings, the last the head and the loss), the transfers and the machine add.

What limits it on a small machine: every rank is a process of the same machine, so with
more ranks than cores (or other work on the machine) the "parallel" stages take turns on
the cores and the step time is the CPU's, not the pipeline's (``load_average`` is in the
report); gloo's point-to-point transfers go through TCP on the loopback, a fixed cost per
micro-batch and stage boundary that the micro-batches multiply; and small micro-batches
run the model's matrices at a lower rate per sequence, so more micro-batches shrink the
bubble but not always the step.

Memory (``--sections memory``): one step of the example at its own size (4 blocks) and
at ``--big-layers`` blocks, for ddp, pipeline 2 (2 ranks) and pipeline 4 (4 ranks), from
the ``shard_memory`` plugin (benchmarks/shard_memory.py: ``Strategy.memory``, i.e.
ddpx/strategies/shards.py's ``local_bytes``, after the first optimizer step): per rank the
bytes of parameters, gradients and AdamW state, and ``vs_ddp``: parameters + optimizer
state over ddp's (the largest rank's, and each rank's). ``floor``: what every stage holds
whatever the stage count: the parameters that are not in a block (the token and position
embeddings, the final norm, the head, tied to the token embedding) over the whole model;
``expected``: floor + (1 - floor) / stages with the blocks split evenly.

Usage: python benchmarks/bench_model_parallel.py [--sections timing,memory] [--rounds 1]
       [--schedules 1f1b,gpipe,interleaved_1f1b] [--microbatches 2,4,8] [--layers 8]
       [--steps 6] [--json] [--out FILE]
(about 20 s per cell on 2 cores: 10 timing cells per round, 6 memory cells)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchjson import emit

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CONFIG = ROOT / "examples" / "char_gpt" / "config.yaml"
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")
PER_RANK = {"interleaved_1f1b": 2}  # pipeline.stages_per_rank


def common_overrides(layers: int, width: int, steps: int, batch: int) -> list[str]:
    """The example at ``layers`` x ``width``, deterministic and fp32, nothing but training steps."""
    return [f"model.args.n_layer={layers}", f"model.args.n_embd={width}", f"model.args.n_head={max(1, width // 32)}",
            "model.args.dropout=0.0", "amp.enabled=false", f"trainer.batch_size={batch}",
            f"trainer.max_steps={steps}", f"scheduler.args.total_steps={steps}", "scheduler.args.warmup_steps=1",
            "accumulation.steps=1", "trainer.eval_every_epochs=0", "checkpoint.enabled=false",
            "comm_monitor.enabled=false", "logging.progress=false", "comm_hook.name=allreduce", "comm_hook.options={}"]


def pipeline_overrides(stages: int, schedule: str, micro: int) -> list[str]:
    return ["trainer.strategy=pipeline", f"pipeline.stages={stages}", f"pipeline.schedule={schedule}",
            f"pipeline.microbatches={micro}", f"pipeline.stages_per_rank={PER_RANK.get(schedule, 1)}"]


def ideal_bubble(schedule: str, stages: int, micro: int) -> float:
    """The schedule's idle fraction per stage with equal stages and free transfers."""
    v = PER_RANK.get(schedule, 1)  # 1f1b with fewer micro-batches than stages runs as GPipe: the same bubble
    return (stages - 1) / (v * micro + stages - 1)


def run_ddpx(overrides: list[str], nproc: int, workdir: Path, args) -> tuple[int, Path]:
    """One ``ddpx train`` of ``nproc`` ranks; its exit code and run directory."""
    run_dir = workdir / "run"
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
               PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT), str(ROOT / "plugins"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "ddpx", "train", str(CONFIG), f"launch.nproc_per_node={nproc}", f"run_dir={run_dir}",
           *overrides]
    with open(workdir / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=workdir, start_new_session=True)
        try:
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the launch's own session: its ranks and nothing else
            proc.wait()
    return proc.returncode, run_dir


def failure(code: int, workdir: Path, timeout: float) -> dict:
    tail = (workdir / "log.txt").read_text()[-1500:]
    return {"error": f"exit code {code} (hung runs are killed after {timeout:g} s); the log ends:\n{tail}"}


# --- timing ---------------------------------------------------------------------------------


def stage_figures(record: dict, warmup: int) -> dict:
    """One rank's per-step medians from its stage_timing record, over the steps after ``warmup``."""
    steps = record["steps"][warmup - 1:]
    deltas = [{k: b[k] - a[k] for k in b} for a, b in zip(steps, steps[1:])]
    med = lambda key: statistics.median(d[key] for d in deltas)  # noqa: E731
    out = {"ms_per_step": 1e3 * med("step_end_s"), "forward_backward_ms": 1e3 * med("forward_backward_s")}
    if "forward_backward_cpu_s" in deltas[0]:  # the main thread on a core, over forward_backward's wall time
        out["on_cpu"] = statistics.median(d["forward_backward_cpu_s"] / d["forward_backward_s"] for d in deltas)
    if record["strategy"] == "pipeline":
        fractions = {"idle": [], "p2p": [], "sync": [], "other": []}
        if "compute_cpu_s" in deltas[0]:  # computing by the wall clock, but not on a core: other processes ran
            out["preempted"] = statistics.median((d["compute_s"] - d["compute_cpu_s"]) / d["forward_backward_s"]
                                                 for d in deltas)
        for d in deltas:
            fb = d["forward_backward_s"]
            fractions["idle"].append((fb - d["compute_s"]) / fb)
            fractions["p2p"].append(d["wait_s"] / fb)
            fractions["sync"].append((fb - d["schedule_s"]) / fb)
            fractions["other"].append((d["schedule_s"] - d["wait_s"] - d["compute_s"]) / fb)
        out.update({k: statistics.median(v) for k, v in fractions.items()})
        out["compute_ms"] = 1e3 * med("compute_s")
        out["stages"] = record["stages"]
    return out


def run_timing_cell(cell: dict, args, workdir: Path) -> dict:
    steps = args.warmup + args.steps
    batch = args.batch if cell["strategy"] == "pipeline" else args.batch // args.ranks
    overrides = common_overrides(args.layers, args.width, steps, batch) + ["plugins.enable=[stage_timing]"]
    if cell["strategy"] == "pipeline":
        overrides += pipeline_overrides(args.ranks, cell["schedule"], cell["microbatches"])
    code, run_dir = run_ddpx(overrides, args.ranks, workdir, args)
    files = [run_dir / f"stage_timing_rank{r}.json" for r in range(args.ranks)]
    if code != 0 or not all(f.exists() for f in files):
        return failure(code, workdir, args.timeout)
    ranks = [stage_figures(json.loads(f.read_text()), args.warmup) for f in files]
    return {"ms_per_step": ranks[0]["ms_per_step"], "ranks": ranks, "load_average": os.getloadavg()[0]}


def timing_cells(args) -> dict:
    cells = {"ddp": {"strategy": "ddp"}}
    for schedule in args.schedules:
        for micro in args.microbatches:
            cells[f"{schedule}/m{micro}"] = {"strategy": "pipeline", "schedule": schedule, "microbatches": micro}
    return cells


def summarize_timing(rounds: list[dict], cells: dict, args) -> dict:
    summary = {}
    for name, cell in cells.items():
        runs = [r[name] for r in rounds if "error" not in r.get(name, {"error": None})]
        if not runs:
            continue
        ms = statistics.median(r["ms_per_step"] for r in runs)
        ratios = [r[name]["ms_per_step"] / r["ddp"]["ms_per_step"] for r in rounds
                  if "ms_per_step" in r.get(name, {}) and "ms_per_step" in r.get("ddp", {})]
        s = {**cell, "ms_per_step": ms, "vs_ddp": statistics.median(ratios) if ratios else None,
             "sequences_per_s": args.batch / ms * 1e3, "load_average": [r.get("load_average") for r in runs]}
        if all("on_cpu" in rank for r in runs for rank in r["ranks"]):
            s["on_cpu"] = statistics.median(statistics.mean(rank["on_cpu"] for rank in r["ranks"]) for r in runs)
        if cell["strategy"] == "pipeline":
            s["ideal_bubble"] = ideal_bubble(cell["schedule"], args.ranks, cell["microbatches"])
            s["stages"] = [{k: statistics.median(r["ranks"][i][k] for r in runs) for k in
                            ("idle", "p2p", "sync", "other", "compute_ms", "forward_backward_ms", "on_cpu", "preempted")
                            if all(k in r["ranks"][i] for r in runs)}
                           | {"stages": runs[0]["ranks"][i]["stages"]} for i in range(args.ranks)]
            s["idle_mean"] = statistics.mean(st["idle"] for st in s["stages"])
        summary[name] = s
    return summary


def timing_table(section: dict) -> str:
    a = section["args"]
    head = (f"timing: char GPT {a['layers']} x {a['width']} ({section['parameters'] / 1e6:.2f} M parameters), {a['ranks']} "
            f"ranks x {a['threads']} thread, batch {a['batch']} x 64 per step (ddp: {a['batch'] // a['ranks']} per rank), "
            f"fp32, median of {a['steps']} steps x {a['rounds']} round(s); load average {section['load_average'][0]:.1f} "
            f"-> {section['load_average'][1]:.1f} on {os.cpu_count()} cores")
    ranks = a["ranks"]
    rows = [("cell", "ms/step", "x ddp", "seq/s", "on cpu", "ideal", *[f"idle s{i}" for i in range(ranks)],
             *[f"p2p s{i}" for i in range(ranks)], *[f"sync s{i}" for i in range(ranks)],
             *[f"preempt s{i}" for i in range(ranks)])]
    for name, s in section["summary"].items():
        row = [name, f"{s['ms_per_step']:.0f}", f"{s['vs_ddp']:.2f}" if s["vs_ddp"] else "", f"{s['sequences_per_s']:.0f}",
               f"{s['on_cpu']:.2f}" if "on_cpu" in s else ""]
        if "stages" in s:
            row += [f"{s['ideal_bubble']:.2f}", *[f"{st['idle']:.2f}" for st in s["stages"]],
                    *[f"{st['p2p']:.2f}" for st in s["stages"]], *[f"{st['sync']:.2f}" for st in s["stages"]],
                    *[f"{st['preempted']:.2f}" if "preempted" in st else "" for st in s["stages"]]]
        else:
            row += [""] * (1 + 4 * ranks)
        rows.append(tuple(row))
    notes = [f"{name}: FAILED in round {i}: {e['error']}" for i, r in enumerate(section["rounds_raw"])
             for name, e in r.items() if "error" in e]
    notes.append("idle sN: the fraction of stage N's forward+backward wall time not spent in its own compute; p2p: of "
                 "it, blocked in the schedule's point-to-point waits; sync: after the schedule (loss broadcast, sum of "
                 "the non-block gradients: waiting for the other stages to finish); ideal: (p-1)/(m+p-1), interleaved "
                 "(p-1)/(v m+p-1); on cpu: the ranks' main-thread CPU time over forward+backward wall time (mean over "
                 "ranks); preempt sN: stage N computing by the wall clock but not on a core (other processes ran), a "
                 "share of its forward+backward that counts as compute, not idle")
    return _columns(head, rows, notes)


def _columns(head: str, rows: list, notes: list) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    return "\n".join([head, lines[0], "-" * len(lines[0]), *lines[1:], *notes])


# --- memory ---------------------------------------------------------------------------------


def model_split(layers: int, width: int) -> dict:
    """Parameters of the example's GPT at ``layers`` x ``width``: all, and those not in a block."""
    sys.path.insert(0, str(CONFIG.parent))
    import yaml
    from gpt import GPT

    model_args = {**yaml.safe_load(CONFIG.read_text())["model"]["args"], "n_layer": layers, "n_embd": width,
                  "n_head": max(1, width // 32), "dropout": 0.0}
    model = GPT(**model_args)
    total = sum(p.numel() for p in model.parameters())  # each tied tensor once
    blocks = sum(p.numel() for p in model.blocks.parameters())
    return {"parameters": total, "block_parameters": blocks, "other_parameters": total - blocks}


def run_memory_cell(layers: int, strategy: str, stages: int, args, workdir: Path) -> dict:
    nproc = stages if strategy == "pipeline" else 2
    micro = 4
    overrides = common_overrides(layers, args.width, 1, 8) + ["plugins.enable=[shard_memory]"]
    if strategy == "pipeline":
        overrides += pipeline_overrides(stages, "1f1b", micro)
    code, run_dir = run_ddpx(overrides, nproc, workdir, args)
    files = [run_dir / f"shard_memory_rank{r}.json" for r in range(nproc)]
    if code != 0 or not all(f.exists() for f in files):
        return failure(code, workdir, args.timeout)
    keys = ("parameters", "gradients", "optimizer")
    return {"ranks": [{k: json.loads(f.read_text())[k] for k in keys} for f in files]}


def memory_section(args, tmp: Path) -> dict:
    out = {}
    for layers in args.memory_layers:
        split = model_split(layers, args.width)
        floor = split["other_parameters"] / split["parameters"]
        cells = {}
        for strategy, stages in (("ddp", 1), ("pipeline", 2), ("pipeline", 4)):
            name = "ddp" if strategy == "ddp" else f"pipeline{stages}"
            workdir = tmp / f"memory_{layers}" / name
            workdir.mkdir(parents=True)
            cells[name] = run_memory_cell(layers, strategy, stages, args, workdir)
            if not args.json:
                print(f"memory n_layer={layers} {name}: " + json.dumps(cells[name])[:300], flush=True)
        ddp = cells["ddp"]
        if "error" not in ddp:
            held = lambda r: r["parameters"] + r["optimizer"]  # noqa: E731
            base = held(ddp["ranks"][0])
            for name, cell in cells.items():
                if "error" in cell:
                    continue
                stages = 1 if name == "ddp" else int(name[len("pipeline"):])
                cell["vs_ddp_ranks"] = [held(r) / base for r in cell["ranks"]]
                cell["vs_ddp"] = max(cell["vs_ddp_ranks"])
                cell["with_gradients_vs_ddp"] = max(sum(r.values()) for r in cell["ranks"]) / sum(ddp["ranks"][0].values())
                cell["expected"] = floor + (1 - floor) / stages
                cell["one_over_stages"] = 1 / stages
        out[f"n_layer={layers}"] = {**split, "floor": floor, "cells": cells}
    return out


def memory_table(section: dict, width: int) -> str:
    rows = [("model", "cell", "params+AdamW MB (max rank)", "vs ddp", "each rank", "expected", "1/stages", "floor")]
    for model, m in section.items():
        for name, c in m["cells"].items():
            if "error" in c:
                rows.append((model, name, "FAILED", "", "", "", "", ""))
                continue
            mb = max(r["parameters"] + r["optimizer"] for r in c["ranks"]) / 1e6
            rows.append((f"{model} ({m['parameters'] / 1e6:.2f} M)", name, f"{mb:.2f}", f"{c['vs_ddp']:.3f}",
                         " ".join(f"{v:.3f}" for v in c["vs_ddp_ranks"]), f"{c['expected']:.3f}",
                         f"{c['one_over_stages']:.3f}", f"{m['floor']:.3f}"))
    notes = [f"{model}: {name} FAILED: {c['error']}" for model, m in section.items() for name, c in m["cells"].items()
             if "error" in c]
    notes.append("vs ddp: parameters + AdamW state of the largest rank over a ddp rank's, after one step (Strategy.memory); "
                 "floor: the non-block parameters (embeddings, final norm, tied head) every stage keeps; expected: "
                 "floor + (1 - floor) / stages")
    return _columns(f"memory: char GPT n_embd {width}, per rank after one optimizer step", rows, notes)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default="timing,memory", help="comma-separated: timing, memory")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help=f"comma-separated, from {', '.join(SCHEDULES)}")
    p.add_argument("--microbatches", default="2,4,8", help="comma-separated micro-batch counts (each divides --batch)")
    p.add_argument("--ranks", type=int, default=2, help="ranks (= pipeline stages) of the timing cells")
    p.add_argument("--layers", type=int, default=8, help="the GPT's n_layer for the timing cells")
    p.add_argument("--width", type=int, default=128, help="the GPT's n_embd (n_head = n_embd / 32)")
    p.add_argument("--batch", type=int, default=32, help="sequences of 64 characters per step (per pipeline)")
    p.add_argument("--memory-layers", default="4,16", help="comma-separated n_layer of the memory cells (4: the example)")
    p.add_argument("--rounds", type=int, default=1, help="every timing cell once per round")
    p.add_argument("--warmup", type=int, default=2, help="optimizer steps before the timed ones")
    p.add_argument("--steps", type=int, default=6, help="timed optimizer steps per run")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (OMP_NUM_THREADS)")
    p.add_argument("--timeout", type=float, default=240, help="seconds per run")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    sections = args.sections.split(",")
    args.schedules = args.schedules.split(",")
    args.microbatches = [int(m) for m in args.microbatches.split(",")]
    args.memory_layers = [int(n) for n in args.memory_layers.split(",")]
    bad = [s for s in sections if s not in ("timing", "memory")] + [s for s in args.schedules if s not in SCHEDULES]
    if bad:
        p.error(f"unknown {', '.join(bad)}: --sections from timing, memory; --schedules from {', '.join(SCHEDULES)}")
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be at least 1 (the first step learns the stages' shapes)")
    if any(args.batch % m for m in args.microbatches) or args.batch % args.ranks:
        p.error(f"--batch {args.batch} must be a multiple of every --microbatches and of --ranks")
    if args.layers < 2 * args.ranks:
        p.error(f"--layers {args.layers}: the interleaved schedule needs 2 blocks per rank ({2 * args.ranks})")
    import torch

    report = {"torch": torch.__version__, "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="bench_model_parallel_") as tmp:
        if "timing" in sections:
            cells = timing_cells(args)
            start_load, rounds = os.getloadavg(), []
            for i in range(args.rounds):
                done = {}
                for name, cell in cells.items():
                    workdir = Path(tmp) / f"round{i}" / name.replace("/", "_")
                    workdir.mkdir(parents=True)
                    started = time.monotonic()
                    done[name] = run_timing_cell(cell, args, workdir)
                    if not args.json:
                        shown = {k: v for k, v in done[name].items() if k in ("ms_per_step", "error")}
                        print(f"round {i} {name} ({time.monotonic() - started:.0f} s): {json.dumps(shown)}", flush=True)
                rounds.append(done)
            report["timing"] = {"args": {k: getattr(args, k) for k in ("ranks", "layers", "width", "batch", "threads",
                                                                        "steps", "warmup", "rounds")},
                                "parameters": model_split(args.layers, args.width)["parameters"],
                                "load_average": [start_load[0], os.getloadavg()[0]],
                                "summary": summarize_timing(rounds, cells, args), "rounds_raw": rounds}
        if "memory" in sections:
            report["memory"] = memory_section(args, Path(tmp))
    report["limits"] = ("every rank is a process on this machine's cores: with other work on them (load_average) the "
                        "stages take turns on the CPU; gloo point-to-point transfers over TCP loopback cost per "
                        "micro-batch and stage boundary; small micro-batches compute less efficiently")
    if not emit(report, args.out, args.json):
        if "timing" in report:
            print(timing_table(report["timing"]))
        if "memory" in report:
            print(memory_table(report["memory"], args.width))
        print("limits: " + report["limits"])
    failed = any("error" in c for r in report.get("timing", {}).get("rounds_raw", []) for c in r.values()) or \
        any("error" in c for m in report.get("memory", {}).values() for c in m["cells"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

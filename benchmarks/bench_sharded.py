"""Sharded training against ddp on two hosts joined by a shaped link: per-rank memory,
step time and the bytes a rank sends, through ``ddpx train`` (the user's path).

Two network-namespace "hosts" (tests/harness.two_hosts, both directions shaped with
``tc ... tbf rate RATE``, 1 Gbit/s by default; root and ``ip netns`` needed), one rank
each, train the char GPT example (examples/char_gpt/config.yaml) widened to ``--width``
x ``--layers`` (4 x 640: 19.8 M parameters, 79 MB of fp32 gradients), bf16 AMP as the
example, AdamW, batch ``--batch`` x 64 characters, accumulation off, no evaluation, no
checkpoint. Cells (``--cells``), each one ``ddpx train`` per host:

* ``ddp``: DDP's own all-reduce (``comm_hook.name=allreduce``), the baseline;
* ``fsdp``: ``trainer.strategy=fsdp``, fp32 reduce-scatter;
* ``fsdp_reduce_bf16``: ``fsdp.reduce_dtype=bf16``;
* ``fsdp_int8``, ``fsdp_bf16``: the compressed reduce-scatter (``comm_hook.name=int8`` /
  ``bf16`` under fsdp: ddpx/comm_hooks/reduce_scatter.py, compressing from the first
  step, fp32 gradients); a cell that ddpx refuses to
  configure is reported as skipped with ddpx's own line.

The cells run in rounds (``--rounds``), every cell once per round, so that load from
other work on the machine hits them alike; each cell's step time is also given as its
ratio to ddp's in the same round (the median over rounds). Measured per cell by the
``shard_memory`` plugin (benchmarks/shard_memory.py), on rank 0:

* ``parameters``, ``gradients``, ``optimizer``: bytes this rank holds after the first
  optimizer step (its shards under fsdp), and their total as a fraction of ddp's;
* ``ms_per_step``: the median time between optimizer steps after ``--warmup`` steps;
* ``sent_bytes_per_step``: what the rank's host sent on its link per step (every
  collective: all-gathers, reduce-scatter, all-reduce; TCP/IP headers included);
* ``reduce_bytes_per_step``: what the gradients' reduction sends per step: the
  compressed comm's own counter where there is one, else the ring formula
  (ddp: 2 (w-1)/w of the fp32 gradients; fsdp: (w-1)/w of them in ``fsdp.reduce_dtype``),
  and ``reduce_vs_fp32``: that over the fp32 reduce-scatter's bytes (the counter's own
  fp32 figure where it keeps one). Over gloo, FSDP's own reduce-scatter is an all-reduce
  of the whole gradient on the wire (``sent_bytes_per_step`` shows it), twice the formula;
* ``link_ms``: ``sent_bytes_per_step`` at the link's rate, the least a step can take;
* ``rss_bytes``, ``peak_rss_bytes``: the rank's resident memory at the end of training
  and at its peak (the whole process: torch, the data, activations and, under fsdp, the
  gathered units; the peak also counts the whole model as built, before fsdp shards it).

Usage: sudo python benchmarks/bench_sharded.py [--rounds 2] [--steps 6] [--cells ddp,fsdp,...]
       [--rate 1gbit] [--json] [--out FILE]
(``DDPX_TEST_NETNS=NSPREFIX,VETHPREFIX,A.B`` names the namespaces and their /16, as for the tests.)
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

from bench_comm import parse_rate
from benchjson import emit

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
import harness  # noqa: E402  (tests/harness.py: two_hosts, free_port)

CONFIG = ROOT / "examples" / "char_gpt" / "config.yaml"
CELLS = {
    "ddp": ["trainer.strategy=ddp"],
    "fsdp": ["trainer.strategy=fsdp"],
    "fsdp_reduce_bf16": ["trainer.strategy=fsdp", "fsdp.reduce_dtype=bf16"],
    "fsdp_int8": ["trainer.strategy=fsdp", "comm_hook.name=int8"],
    "fsdp_bf16": ["trainer.strategy=fsdp", "comm_hook.name=bf16"],
}
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def cell_overrides(cell: str, args) -> list[str]:
    """The cell's ``ddpx train`` overrides: the example widened, short, nothing but training steps."""
    overrides = [f"model.args.n_embd={args.width}", f"model.args.n_layer={args.layers}",
                 f"model.args.n_head={args.width // 64}", f"trainer.batch_size={args.batch}",
                 f"trainer.max_steps={args.warmup + args.steps}", f"scheduler.args.total_steps={args.warmup + args.steps}",
                 "scheduler.args.warmup_steps=1", "accumulation.steps=1", "trainer.eval_every_epochs=0",
                 "checkpoint.enabled=false", "comm_monitor.enabled=false", "logging.progress=false",
                 "comm_hook.name=allreduce", "comm_hook.options={}", "plugins.enable=[shard_memory]"]
    return overrides + CELLS[cell]  # the sharded reduce-scatter compresses from the first step (no warm-up)


def refusal(cell: str, args):
    """ddpx's one line where it refuses the cell's config (a hook not built for fsdp), else None."""
    from ddpx.config import load_config
    from ddpx.errors import DdpxError

    try:
        load_config(str(CONFIG), cell_overrides(cell, args))
    except DdpxError as exc:
        return str(exc)
    return None


def run_cell(cell: str, args, hosts, workdir: Path) -> dict:
    """One ``ddpx train`` per host; rank 0's record from the shard_memory plugin."""
    (_, _, addr0), _ = hosts
    endpoint = f"{addr0}:{harness.free_port()}"
    run_dir = workdir / "run"
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
               PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(name, None)  # ddpx chooses each namespace's interface
    procs = []
    for node, (ns, _, _) in enumerate(hosts):
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "ddpx", "train", str(CONFIG), "--nnodes=2",
               "--nproc-per-node=1", f"--node-rank={node}", "--max-restarts=0", "--rdzv-backend=static",
               f"--rdzv-endpoint={endpoint}", f"run_dir={run_dir}", *cell_overrides(cell, args)]
        log = open(workdir / f"host{node}.log", "w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
                                      start_new_session=True))
    deadline = time.monotonic() + args.timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    codes = [proc.returncode for proc in procs]
    found = run_dir / "shard_memory_rank0.json"
    if codes != [0, 0] or not found.exists():
        tail = (workdir / "host0.log").read_text()[-1500:]
        return {"error": f"exit codes {codes} (hung runs are killed after {args.timeout:g} s); host 0's log ends:\n{tail}"}
    return measure(json.loads(found.read_text()), args.warmup)


def measure(record: dict, warmup: int) -> dict:
    """Per-step figures from one rank's record, over the steps after `warmup`."""
    ends, sent = record["step_end_s"][warmup - 1:], record["sent_bytes"][warmup - 1:]
    steps = len(ends) - 1
    out = {k: record.get(k) for k in ("parameters", "gradients", "optimizer", "total", "world_size", "peak_rss_bytes",
                                      "rss_bytes")}
    out["ms_per_step"] = 1e3 * statistics.median(b - a for a, b in zip(ends, ends[1:]))
    out["sent_bytes_per_step"] = (sent[-1] - sent[0]) / steps if sent[0] is not None else None
    first, last = record.get("hook_first"), record.get("hook_last")
    if first and last and last["steps"] > first["steps"]:  # the comm's own counter (all but the first step)
        steps = last["steps"] - first["steps"]
        out["hook_wire_bytes_per_step"] = (last["wire_bytes"] - first["wire_bytes"]) / steps
        if "fp32_wire_bytes" in last:  # the compressed reduce-scatter's fp32 counterpart, padding included
            out["hook_fp32_wire_bytes_per_step"] = (last["fp32_wire_bytes"] - first["fp32_wire_bytes"]) / steps
    return out


def reduce_bytes(cell: str, result: dict, grad_bytes_fp32: float, world: int) -> float:
    """Bytes a rank sends per step to reduce the gradients: the comm's counter, else the ring formula."""
    if "hook_wire_bytes_per_step" in result:
        return result["hook_wire_bytes_per_step"]
    if cell == "ddp":
        return 2 * (world - 1) / world * grad_bytes_fp32
    dtype = next((o.split("=", 1)[1] for o in CELLS[cell] if o.startswith("fsdp.reduce_dtype=")), "fp32")
    return (world - 1) / world * grad_bytes_fp32 * BYTES[dtype] / 4


def summarize(rounds: list[dict], cells: list[str], rate_bps: float) -> dict:
    summary = {}
    for cell in cells:
        runs = [r[cell] for r in rounds if cell in r and "error" not in r[cell] and "skipped" not in r[cell]]
        if not runs:
            continue
        ratios = [r[cell]["ms_per_step"] / r["ddp"]["ms_per_step"] for r in rounds
                  if "ms_per_step" in r.get(cell, {}) and "ms_per_step" in r.get("ddp", {})]
        last = runs[-1]
        world = last["world_size"]
        grad_fp32 = rounds[0]["ddp"]["gradients"] if "gradients" in rounds[0].get("ddp", {}) else None
        s = {k: last[k] for k in ("parameters", "gradients", "optimizer", "total")}
        s["ms_per_step"] = statistics.median(r["ms_per_step"] for r in runs)
        s["vs_ddp"] = statistics.median(ratios) if ratios else None
        s["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in runs)
        s["rss_bytes"] = max((r["rss_bytes"] for r in runs if r.get("rss_bytes") is not None), default=None)
        sent = [r["sent_bytes_per_step"] for r in runs if r["sent_bytes_per_step"] is not None]
        s["sent_bytes_per_step"] = statistics.median(sent) if sent else None
        s["link_ms"] = s["sent_bytes_per_step"] * 8 / rate_bps * 1e3 if sent else None  # what the link alone needs
        if grad_fp32:
            s["memory_vs_ddp"] = s["total"] / rounds[0]["ddp"]["total"]
            s["reduce_bytes_per_step"] = reduce_bytes(cell, last, grad_fp32, world)
            s["reduce_source"] = "counter" if "hook_wire_bytes_per_step" in last else "ring formula"
            fp32 = last.get("hook_fp32_wire_bytes_per_step", (world - 1) / world * grad_fp32)
            s["reduce_vs_fp32"] = s["reduce_bytes_per_step"] / fp32
        summary[cell] = s
    return summary


def table(report: dict) -> str:
    head = (f"{report['world_size']} hosts x 1 rank, {report['rate']} links, GPT {report['parameters'] / 1e6:.1f} M "
            f"parameters, batch {report['batch']} x 64, median of {report['steps']} steps x {report['rounds']} rounds")
    rows = [("cell", "params MB", "grads MB", "optim MB", "total MB", "/ddp", "ms/step", "x ddp", "sent MB/step", "link ms",
             "reduce MB/step", "/fp32 RS", "RSS MB", "peak RSS MB")]
    for cell, s in report["summary"].items():
        mb = lambda v: f"{v / 1e6:.1f}" if v is not None else ""  # noqa: E731
        rows.append((cell, mb(s["parameters"]), mb(s["gradients"]), mb(s["optimizer"]), mb(s["total"]),
                     f"{s.get('memory_vs_ddp', 0):.3f}", f"{s['ms_per_step']:.0f}",
                     f"{s['vs_ddp']:.2f}" if s["vs_ddp"] else "", mb(s["sent_bytes_per_step"]),
                     f"{s['link_ms']:.0f}" if s["link_ms"] is not None else "",
                     mb(s.get("reduce_bytes_per_step")) + (" (c)" if s.get("reduce_source") == "counter" else ""),
                     f"{s['reduce_vs_fp32']:.2f}" if "reduce_vs_fp32" in s else "", mb(s["rss_bytes"]),
                     mb(s["peak_rss_bytes"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    notes = [f"{cell}: skipped: {why}" for cell, why in report["skipped"].items()]
    notes += [f"{cell}: FAILED in round {i}: {e}" for i, r in enumerate(report["rounds_raw"])
              for cell, e in r.items() if isinstance(e, dict) and "error" in e]
    notes.append("reduce MB: the ring formula, (c): the compressed comm's own counter; /fp32 RS: over an fp32 "
                 "reduce-scatter's bytes; sent MB: all the host sent on its link per step; link ms: that at the link's rate "
                 "(a step far above it is bound by the CPU, not the link)")
    return "\n".join([head, lines[0], "-" * len(lines[0]), *lines[1:], *notes])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", default=",".join(CELLS), help=f"comma-separated, from {', '.join(CELLS)}")
    p.add_argument("--rounds", type=int, default=2, help="every cell once per round")
    p.add_argument("--warmup", type=int, default=2, help="optimizer steps before the timed ones")
    p.add_argument("--steps", type=int, default=6, help="timed optimizer steps per run")
    p.add_argument("--width", type=int, default=640, help="the GPT's n_embd (a multiple of 64)")
    p.add_argument("--layers", type=int, default=4, help="the GPT's n_layer")
    p.add_argument("--batch", type=int, default=4, help="sequences of 64 characters per rank")
    p.add_argument("--rate", default="1gbit", help="link rate per direction, tc syntax")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--timeout", type=float, default=240, help="seconds per run")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    cells = args.cells.split(",")
    unknown = [c for c in cells if c not in CELLS]
    if unknown or "ddp" not in cells:
        p.error(f"--cells: {'unknown ' + ', '.join(unknown) if unknown else 'ddp is the baseline and must be one'}; "
                f"choose from {', '.join(CELLS)}")
    if args.width % 64:
        p.error(f"--width {args.width} must be a multiple of 64 (64 per attention head)")
    if not harness.netns_available(tc=True):
        raise SystemExit("bench_sharded: needs root, `ip netns` and `tc` (network namespaces as hosts)")
    sys.path.insert(0, str(HERE))
    skipped = {c: why for c in cells if (why := refusal(c, args))}
    cells = [c for c in cells if c not in skipped]
    rounds = []
    with tempfile.TemporaryDirectory(prefix="bench_sharded_") as tmp, harness.two_hosts(rate=args.rate) as hosts:
        for i in range(args.rounds):
            done = {}
            for cell in cells:
                workdir = Path(tmp) / f"round{i}" / cell
                workdir.mkdir(parents=True)
                done[cell] = run_cell(cell, args, hosts, workdir)
                if not args.json:
                    print(f"round {i} {cell}: " + json.dumps({k: v for k, v in done[cell].items()
                                                              if k in ("ms_per_step", "total", "error")}), flush=True)
            rounds.append(done)
    import torch

    ddp = next((r["ddp"] for r in rounds if "gradients" in r["ddp"]), None)
    report = {"rate": args.rate, "world_size": 2, "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
              "rounds": args.rounds, "width": args.width, "layers": args.layers, "torch": torch.__version__,
              "parameters": ddp["parameters"] / 4 if ddp else 0, "load_average": os.getloadavg()[0],
              "skipped": skipped, "summary": summarize(rounds, cells, parse_rate(args.rate)), "rounds_raw": rounds}
    if not emit(report, args.out, args.json):
        print(table(report))
    return 0 if all("error" not in r[c] for r in rounds for c in r) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Convergence of every comm hook at its defaults on transformers trained with AdamW.

The digits matrix (bench_convergence.py) is too easy a judge: there every hook lands
within a point of allreduce. Most users train transformers with AdamW, where Adam's
division by the root of its second moment turns error-compensated gradient
compression into a different update. This benchmark is what such a user writes: a
plain torchrun DDP script (``DistributedSampler`` + ``set_epoch``, ``DDP(model)``,
``torch.optim.AdamW``, a warm-up + cosine schedule, ``clip_grad_norm_``) plus one
line, ``ddpx.comm_hooks.register(ddp, name)``, no options (and ``state.pair(opt)``); for ``onebit_adam`` the
optimizer is ``ddpx.optim.OneBitAdam`` with AdamW's arguments instead.

Configs (the char GPT of examples/char_gpt on Shakespeare's sonnets; AdamW lr 3e-3,
betas 0.9/0.99, weight decay 0.1, 40 warm-up steps then cosine, clip 1.0, 2 gloo
ranks, 400 optimizer steps):

    gpt4x128      4 blocks, 128 wide, 4 heads, context 64, batch 16 per rank (the example's model)
    gpt2x128c128  2 blocks, 128 wide, 4 heads, context 128, batch 8 per rank

For every config and seed it trains once with no hook (DDP's allreduce) and once per
hook, same seed and data order, and reports each hook's final eval loss (nats/char,
the whole validation split) minus allreduce's, the mean over seeds, and the bytes
one rank sends per step (ring model, ``state.stats()``): over the whole run and in
the compressed stage (after the hook's warm-up), also as a fraction of fp32's.

    python benchmarks/bench_convergence_gpt.py                      # the table
    python benchmarks/bench_convergence_gpt.py --json out.json      # also the numbers
    python benchmarks/bench_convergence_gpt.py --configs gpt4x128 --seeds 1 --hooks onebit_adam,powersgd:rank=8

Without ``RANK`` in the environment it starts itself under
``torch.distributed.run --nproc_per_node 2``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from bench_convergence import hand_rows_back, parse_hook, rows_from_ranks, write_json

HERE = os.path.dirname(os.path.abspath(__file__))
CHAR_GPT = os.path.join(os.path.dirname(HERE), "examples", "char_gpt")

CONFIGS = {
    "gpt4x128": dict(n_layer=4, n_embd=128, n_head=4, block_size=64, batch=16),
    "gpt2x128c128": dict(n_layer=2, n_embd=128, n_head=4, block_size=128, batch=8),
}
HOOKS = ("fp16", "bf16", "int8", "onebit", "onebit_adam", "powersgd")
TARGETS = {"fp16": 0.01, "bf16": 0.01, "int8": 0.01, "onebit_adam": 0.03, "powersgd": 0.03}  # nats
STEPS, WARMUP_LR = 400, 40
ADAMW = dict(lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)


def eval_loss(model, data, block_size: int) -> float:
    """Mean next-character loss over every validation window (identical on every rank)."""
    model.eval()
    with torch.no_grad():
        windows = [data[i] for i in range(len(data))]
        idx = torch.stack([w["idx"] for w in windows])
        targets = torch.stack([w["targets"] for w in windows])
        total = sum(float(model(i, t)) * len(i) for i, t in zip(idx.split(64), targets.split(64)))
    model.train()
    return total / len(windows)


def train_run(config: str, hook: str | None, seed: int, steps: int = STEPS) -> dict:
    """One run: ``hook`` None (DDP's allreduce), a hook name (its defaults) or ``name:option=value``."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    import ddpx.comm_hooks
    from ddpx.comm_hooks.state import ring_allreduce_bytes

    if CHAR_GPT not in sys.path:
        sys.path.insert(0, CHAR_GPT)
    import gpt
    import text

    cfg = CONFIGS[config]
    train, val = text.splits(block_size=cfg["block_size"])
    torch.manual_seed(seed)
    model = gpt.GPT(block_size=cfg["block_size"], n_layer=cfg["n_layer"], n_head=cfg["n_head"],
                    n_embd=cfg["n_embd"])
    ddp = DDP(model)  # DDP's defaults, as most users write it
    state = None
    if hook:
        name, options = parse_hook(hook)
        state = ddpx.comm_hooks.register(ddp, name, **options)
    if hook and parse_hook(hook)[0] == "onebit_adam":
        import ddpx.optim

        opt = ddpx.optim.OneBitAdam(ddp.parameters(), comm=state, **ADAMW)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), **ADAMW)
        if state is not None:
            state.pair(opt)  # before the first step: int8's block_size and powersgd's rank auto take AdamW's values
    sched = gpt.warmup_cosine(opt, WARMUP_LR, steps)
    sampler = DistributedSampler(train, seed=seed)
    loader = DataLoader(train, batch_size=cfg["batch"], sampler=sampler, drop_last=True)
    step, epoch, warm_stats = 0, 0, None
    warmup = (state.opts.get("warmup_steps", 0) if state else 0)
    t0 = time.perf_counter()
    while step < steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            if step == warmup and state is not None:
                warm_stats = state.stats()
            opt.zero_grad(set_to_none=True)
            ddp(batch["idx"], batch["targets"]).backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step == steps:
                break
        epoch += 1
    seconds = time.perf_counter() - t0
    loss = eval_loss(model, val, cfg["block_size"])
    check = torch.tensor([loss], dtype=torch.float64)
    dist.all_reduce(check, op=dist.ReduceOp.MAX)
    numel = sum(p.numel() for p in model.parameters())
    fp32 = ring_allreduce_bytes(4 * numel, dist.get_world_size())
    if state is None:
        per_step = compressed = fp32
    else:
        end = state.stats()
        per_step = end["wire_bytes"] / steps
        start = warm_stats or {"wire_bytes": 0, "steps": 0}
        compressed = (end["wire_bytes"] - start["wire_bytes"]) / max(1, steps - warmup)
        state.close()
    return {"eval_loss": loss, "replicas_agree": float(check) == loss, "seconds": seconds,
            "wire_bytes_per_step": per_step, "compressed_bytes_per_step": compressed, "fp32_bytes_per_step": fp32,
            "params": numel}


def run_table(configs, hooks, seeds, steps: int = STEPS, log=None) -> list[dict]:
    """One row per config: allreduce's loss and each hook's mean difference over the seeds."""
    rows = []
    for config in configs:
        t0 = time.perf_counter()
        bases = [train_run(config, None, s, steps) for s in seeds]
        row = {"config": config, **CONFIGS[config], "steps": steps, "seeds": list(seeds),
               "params": bases[0]["params"], "fp32_bytes_per_step": bases[0]["fp32_bytes_per_step"],
               "allreduce": statistics.fmean(b["eval_loss"] for b in bases),
               "allreduce_by_seed": [b["eval_loss"] for b in bases],
               "allreduce_seconds": statistics.fmean(b["seconds"] for b in bases), "hooks": {}}
        for hook in hooks:
            runs = [train_run(config, hook, s, steps) for s in seeds]
            deltas = [r["eval_loss"] - b["eval_loss"] for r, b in zip(runs, bases)]
            row["hooks"][hook] = {
                "delta": statistics.fmean(deltas), "deltas": deltas,
                "eval_loss": statistics.fmean(r["eval_loss"] for r in runs),
                "replicas_agree": all(r["replicas_agree"] for r in runs),
                "wire_bytes_per_step": runs[0]["wire_bytes_per_step"],
                "compressed_bytes_per_step": runs[0]["compressed_bytes_per_step"],
                "seconds": statistics.fmean(r["seconds"] for r in runs)}
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        if log:
            log(row)
    return rows


def misses(rows) -> dict:
    """{hook: worst mean difference over the configs} for the hooks beyond their target."""
    out = {}
    for row in rows:
        for hook, r in row["hooks"].items():
            name = hook.partition(":")[0]
            if name in TARGETS and r["delta"] > TARGETS[name]:
                out[hook] = max(out.get(hook, float("-inf")), round(r["delta"], 4))
    return out


def table(rows, hooks) -> str:
    head = ["config", "params", "steps", "allreduce loss"] + [f"{h} Δ" for h in hooks]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["config"], f"{row['params'] / 1e6:.2f} M", str(row["steps"]), f"{row['allreduce']:.3f}"]
        cells += [f"{row['hooks'][h]['delta']:+.3f}" for h in hooks]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("| config | fp32 bytes/step | " + " | ".join(f"{h} (compressed stage)" for h in hooks) + " |")
    lines.append("|" + "---|" * (len(hooks) + 2))
    for row in rows:
        fp32 = row["fp32_bytes_per_step"]
        cells = [row["config"], f"{fp32 / 1e6:.2f} MB"]
        cells += [f"{row['hooks'][h]['compressed_bytes_per_step'] / 1e6:.3f} MB (1/{fp32 / max(1, row['hooks'][h]['compressed_bytes_per_step']):.1f})"
                  for h in hooks]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _csv(text):
    return tuple(v for v in text.split(",") if v)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--hooks", default=",".join(HOOKS),
                   help="comma-separated hooks, each NAME or NAME:option=value:option=value")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1; each row reports the mean difference")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="write the rows as JSON (to FILE, or stdout)")
    args = p.parse_args(argv)
    for config in _csv(args.configs):
        if config not in CONFIGS:
            p.error(f"--configs: unknown config {config!r}; known: {', '.join(CONFIGS)}")
    return args


def worker(args) -> int:
    import torch.distributed as dist

    from ddpx.rank import process_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def log(row):
        if rank == 0:
            deltas = " ".join(f"{h} {r['delta']:+.3f}" for h, r in row["hooks"].items())
            print(f"{row['config']}: allreduce {row['allreduce']:.3f} | {deltas} ({row['seconds']:.0f} s)",
                  file=sys.stderr, flush=True)

    rows = run_table(_csv(args.configs), _csv(args.hooks), range(args.seeds), args.steps, log)
    if rank == 0:
        hand_rows_back(rows)
    process_group.teardown()
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if "RANK" in os.environ:
        return worker(args)
    rows = rows_from_ranks(__file__, argv)
    if isinstance(rows, int):
        return rows
    hooks = _csv(args.hooks)
    print(table(rows, hooks))
    bad = misses(rows)
    print(f"\nevery hook within its target (int8/fp16/bf16 0.01, onebit_adam/powersgd 0.03 nats): "
          f"{'yes' if not bad else f'no {bad}'}")
    if args.json:
        write_json(args.json, {"targets": TARGETS, "seeds": args.seeds, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The char GPT example (examples/char_gpt) at world size 1 on one device: `ddpx train`'s
steps/s and peak memory against a hand-written DDP loop doing the same work, per variant:

* ``none``: no comm hook (DDP's allreduce);  ``int8``, ``powersgd``: that ddpx hook
  (native C++ path, the trainer's default, compressing from the first step);
* ``compile``, ``compile_int8``: ``torch.compile`` of the DDP model, without / with int8.

Same model (gpt.GPT, 0.82 M parameters), data (every 65-character window, batch 32,
shuffled, the short last batch kept), AdamW, the warm-up/cosine schedule, clip 1.0 and
bf16 autocast as the example's config; one micro-batch per step (accumulation off).
The hand-written loop is what a user writes: ``DDP(model)``, the same hook through
``ddpx.comm_hooks.register``, ``torch.compile(ddp)`` with torch's defaults.

Each run is its own process: peak memory (``torch.cuda.max_memory_allocated()`` over
the whole run, as the issue measured it) and compile caches are per process. Timed:
steps ``--warmup`` to ``--warmup + --steps``, the device synchronized at both ends.
Runs alternate ddpx, hand per variant, so machine load hits both alike. The compile
variants run with ``TORCH_LOGS=recompiles``; their logs go to ``--logdir`` and the
count of recompiles into the JSON.

Usage: python benchmarks/bench_char_gpt.py [--device cuda|cpu] [--variants none,int8,powersgd,compile,compile_int8]
       [--warmup 100] [--steps 300] [--timeout 300] [--logdir DIR] [--json] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchjson import emit

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CHAR_GPT = os.path.join(ROOT, "examples", "char_gpt")
VARIANTS = {  # name: (comm hook or None, compile)
    "none": (None, False),
    "int8": ("int8", False),
    "powersgd": ("powersgd", False),
    "compile": (None, True),
    "compile_int8": ("int8", True),
}


def example_config() -> dict:
    import yaml

    with open(os.path.join(CHAR_GPT, "config.yaml")) as f:
        return yaml.safe_load(f)


def hook_options(hook: str) -> dict:
    """The example's options for its own hook (powersgd rank 4), no warm-up: every timed step compresses."""
    import ddpx.comm_hooks

    cfg = example_config()["comm_hook"]
    options = dict(cfg.get("options") or {}) if cfg["name"] == hook else {}
    return {**options, **ddpx.comm_hooks.without_warmup(hook)}


class Clock:
    """Marks at two steps, the device synchronized first."""

    def __init__(self, device: str, warmup: int, steps: int):
        self.device, self.warmup, self.steps = device, warmup, steps
        self.start = self.first_step = self.seconds = None
        self.t0 = time.perf_counter()

    def sync(self):
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()

    def at(self, step: int) -> None:
        """Call after `step` optimizer steps."""
        if step == 1:
            self.sync()
            self.first_step = time.perf_counter() - self.t0
        if step == self.warmup:
            self.sync()
            self.start = time.perf_counter()
        elif step == self.warmup + self.steps:
            self.sync()
            self.seconds = time.perf_counter() - self.start

    def result(self, loss: float) -> dict:
        import torch

        peak = torch.cuda.max_memory_allocated() if self.device == "cuda" else None
        return {"steps_per_s": self.steps / self.seconds, "first_step_s": self.first_step, "peak_memory_bytes": peak,
                "loss": loss}


def run_ddpx(variant: str, device: str, warmup: int, steps: int) -> dict:
    from ddpx.config import load_config
    from ddpx.train.trainer import Trainer

    hook, compiled = VARIANTS[variant]
    clock = Clock(device, warmup, steps)
    overrides = [f"trainer.max_steps={warmup + steps}", "accumulation.steps=1", f"trainer.device={device}",
                 "trainer.eval_every_epochs=0", "logging.progress=false", "checkpoint.enabled=false",
                 "comm_monitor.enabled=false", f"trainer.compile={str(compiled).lower()}",
                 f"comm_hook.name={hook or 'allreduce'}", f"comm_hook.options={json.dumps(hook_options(hook) if hook else {})}",
                 f"run_dir={os.environ['BENCH_RUN_DIR']}"]
    trainer = Trainer(load_config(os.path.join(CHAR_GPT, "config.yaml"), overrides))

    class Marks:  # schedules the clock's marks once the trainer is set up
        from ddpx import hookimpl

        @hookimpl
        def ddpx_train_start(self, trainer):
            for step in (1, warmup, warmup + steps):
                trainer.call_at_step(step, lambda t, s=step: clock.at(s))

    trainer.plugin_manager.register(Marks(), name="bench_char_gpt_marks")
    with trainer:
        trainer.run()
        loss = float(trainer.last_loss)
    return clock.result(loss)


def run_hand(variant: str, device: str, warmup: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    import ddpx.comm_hooks
    from ddpx.rank import process_group

    sys.path.insert(0, CHAR_GPT)
    import gpt
    import text

    cfg = example_config()
    hook, compiled = VARIANTS[variant]
    clock = Clock(device, warmup, steps)
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    torch.manual_seed(cfg["seed"])
    model = gpt.GPT(**cfg["model"]["args"]).to(device)
    ddp = DDP(model, device_ids=[0] if device == "cuda" else None, **(ddpx.comm_hooks.ddp_options(hook) if hook else {}))
    state = ddpx.comm_hooks.register(ddp, hook, **hook_options(hook)) if hook else None
    run = torch.compile(ddp) if compiled else ddp
    train_set, _ = text.splits(**cfg["data"]["args"])
    sampler = DistributedSampler(train_set, seed=cfg["seed"])
    loader = DataLoader(train_set, batch_size=cfg["trainer"]["batch_size"], sampler=sampler)
    opt = torch.optim.AdamW(model.parameters(), **cfg["optimizer"]["args"])
    if state is not None:
        state.pair(opt)  # as ddpx train pairs it: int8's block_size and powersgd's rank auto take AdamW's values
    schedule = gpt.warmup_cosine(opt, **cfg["scheduler"]["args"])
    step, epoch = 0, 0
    while step < warmup + steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = run(**batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["trainer"]["grad_clip"])
            opt.step()
            schedule.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            clock.at(step)
            if step == warmup + steps:
                break
        epoch += 1
    result = clock.result(float(loss))
    del run, ddp  # the reducer before the group it holds
    process_group.teardown()
    return result


def child(loop: str, variant: str, device: str, warmup: int, steps: int) -> None:
    """One run, in this process; prints its result as the last line."""
    from bench_trainer_overhead import one_rank_env

    os.environ.update(one_rank_env())
    result = (run_ddpx if loop == "ddpx" else run_hand)(variant, device, warmup, steps)
    print(json.dumps({"loop": loop, "variant": variant, **result}), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (torch + gloo abort there now and then)


def one_run(loop, variant, args, logdir) -> dict:
    import tempfile

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")]))
    if VARIANTS[variant][1]:
        env["TORCH_LOGS"] = "recompiles"
    log = os.path.join(logdir, f"char_gpt_{variant}_{loop}.log")
    with tempfile.TemporaryDirectory() as run_dir, open(log, "w") as out:
        env["BENCH_RUN_DIR"] = run_dir
        cmd = [sys.executable, __file__, "--child", loop, "--variant", variant, "--device", args.device,
               "--warmup", str(args.warmup), "--steps", str(args.steps)]
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=out, text=True, env=env, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return {"loop": loop, "variant": variant, "error": f"timed out after {args.timeout} s (log: {log})"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"loop": loop, "variant": variant, "error": f"exit {proc.returncode} (log: {log})"}
    result = json.loads(lines[-1])
    with open(log) as f:
        result["recompiles"] = sum("Recompiling function" in line for line in f) if VARIANTS[variant][1] else None
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--variants", default="none,int8,powersgd,compile,compile_int8")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run")
    parser.add_argument("--logdir", default=None, help="where each run's stderr goes (default: a temporary folder)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--child", choices=["ddpx", "hand"], help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.variant, args.device, args.warmup, args.steps)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device; run with --device cpu")
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    logdir = args.logdir or __import__("tempfile").mkdtemp(prefix="bench_char_gpt_")
    os.makedirs(logdir, exist_ok=True)
    runs = []
    for variant in variants:
        for loop in ("ddpx", "hand"):
            runs.append(one_run(loop, variant, args, logdir))
            if not args.json:
                print(json.dumps(runs[-1]), flush=True)
    summary = {}
    for variant in variants:
        ours, hand = (next(r for r in runs if r["variant"] == variant and r["loop"] == loop) for loop in ("ddpx", "hand"))
        if "error" not in ours and "error" not in hand:
            summary[variant] = {"ddpx_steps_per_s": ours["steps_per_s"], "hand_steps_per_s": hand["steps_per_s"],
                                "ratio": ours["steps_per_s"] / hand["steps_per_s"],
                                "ddpx_peak_memory_bytes": ours["peak_memory_bytes"],
                                "hand_peak_memory_bytes": hand["peak_memory_bytes"]}
    report = {"device": args.device, "torch": torch.__version__, "warmup": args.warmup, "steps": args.steps,
              "runs": runs, "summary": summary, "logdir": logdir}
    if not emit(report, args.out, args.json):
        for variant, s in summary.items():
            mem = (f", peak {s['ddpx_peak_memory_bytes'] / 2**20:.0f} / {s['hand_peak_memory_bytes'] / 2**20:.0f} MiB"
                   if s["ddpx_peak_memory_bytes"] is not None else "")
            print(f"{variant:>13}: ddpx {s['ddpx_steps_per_s']:.2f} steps/s, hand {s['hand_steps_per_s']:.2f} "
                  f"(ratio {s['ratio']:.3f}){mem}")
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())

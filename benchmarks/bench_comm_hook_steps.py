"""What a comm hook costs per training step on one rank, where nothing travels
(world size 1): the char GPT example's model (0.82 M parameters, batch 32 x 64,
AdamW, bf16 autocast) trained by two DDP models of the same weights in one
process, one with the hook (compressing from the first step) and one without,
their steps interleaved in rounds so machine load hits both alike.

Reports, per hook and path (native C++ / Python):

* ``ratio``: the median over rounds of (hook step time / no-hook step time);
* ``aten_calls_per_step``: operator calls the profiler records per step
  (``aten::*`` and ``ddpx::*``, nested calls included), with and without the hook,
  and those on the hook's executor thread (the multi-phase hooks' own work);
* ``hook_buffer_bytes``: the hook's persistent buffers (its layouts' tensors), next to
  the model's gradient bytes.

Usage: python benchmarks/bench_comm_hook_steps.py [--hooks powersgd] [--paths native,python] [--rounds 15]
       [--steps 4] [--device cpu|cuda] [--json] [--out FILE]
Run it with PYTHONPATH pointing at another checkout (with its extension built in place)
to measure that one's hooks with the same script.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

from benchjson import emit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAR_GPT = os.path.join(ROOT, "examples", "char_gpt")


def setup(device: str):
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    sys.path.insert(0, CHAR_GPT)
    import gpt

    torch.manual_seed(0)
    model = gpt.GPT(vocab_size=128, block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.1).to(device)
    g = torch.Generator().manual_seed(1)
    batches = [{"idx": torch.randint(0, 128, (32, 64), generator=g).to(device),
                "targets": torch.randint(0, 128, (32, 64), generator=g).to(device)} for _ in range(4)]
    return model, batches


class Loop:
    """One DDP model, its optimizer and its step."""

    def __init__(self, model, device, hook=None, native=True):
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        import ddpx.comm_hooks

        self.model, self.device = copy.deepcopy(model), device
        options = ddpx.comm_hooks.ddp_options(hook) if hook else {}
        self.ddp = DDP(self.model, device_ids=[0] if device == "cuda" else None, **options)
        self.state = None
        if hook:
            warm = {"warmup_steps": 0} if "warmup_steps" in ddpx.comm_hooks.make_state(hook).opts else {}
            self.state = ddpx.comm_hooks.register(self.ddp, hook, native=native, **warm)
            if bool(getattr(self.state, "native", False)) != native:
                raise SystemExit(f"bench_comm_hook_steps: {hook} did not register on the {'native' if native else 'Python'} path")
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        if self.state is not None:
            self.state.pair(self.opt)  # int8's block_size and powersgd's rank auto: AdamW's values
        self.i = 0

    def step(self, batches):
        import torch

        batch = batches[self.i % len(batches)]
        self.i += 1
        with torch.autocast(self.device, dtype=torch.bfloat16):
            loss = self.ddp(**batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def timed(self, batches, steps):
        import torch

        sync = torch.cuda.synchronize if self.device == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            self.step(batches)
        sync()
        return (time.perf_counter() - start) / steps

    def buffer_bytes(self) -> int:
        import torch

        seen, total = set(), 0
        for lay in getattr(self.state, "layouts", {}).values():
            parts = [lay] + list(getattr(lay, "pieces", []))
            for obj in parts:
                for t in vars(obj).values():
                    if isinstance(t, torch.Tensor):
                        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                        if key not in seen:
                            seen.add(key)
                            total += key[1]
        return total


def profile(loop, batches, steps):
    """(operator calls, operator calls off the main thread: the hook's executor) per step. Every thread is recorded where torch can (2.5+'s
    ``profile_all_threads``); elsewhere only the main thread's calls count."""
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    try:
        config = {"experimental_config": torch._C._profiler._ExperimentalConfig(profile_all_threads=True)}
    except (AttributeError, TypeError):
        config = {}
    with torch_profile(activities=[ProfilerActivity.CPU], **config) as prof:
        with torch.profiler.record_function("bench_hook_steps_main"):  # marks the main thread's id
            pass
        for _ in range(steps):
            loop.step(batches)
    main = next(e.thread for e in prof.events() if e.name == "bench_hook_steps_main")
    calls = executor_calls = 0
    for e in prof.events():
        if e.name.startswith(("aten::", "ddpx::")):
            calls += 1
            executor_calls += e.thread != main
    return calls / steps, executor_calls / steps


def measure(hook, native, args, model, batches) -> dict:
    plain, hooked = Loop(model, args.device), Loop(model, args.device, hook, native)
    for loop in (plain, hooked):  # warm-up: buckets rebuilt, layouts built, allocator warm
        for _ in range(3):
            loop.step(batches)
    ratios, times = [], {"plain": [], "hook": []}
    for r in range(args.rounds):
        order = (plain, hooked) if r % 2 == 0 else (hooked, plain)
        t = {id(loop): loop.timed(batches, args.steps) for loop in order}
        times["plain"].append(t[id(plain)])
        times["hook"].append(t[id(hooked)])
        ratios.append(t[id(hooked)] / t[id(plain)])
    calls_plain, _ = profile(plain, batches, args.profile_steps)
    calls_hook, calls_executor = profile(hooked, batches, args.profile_steps)
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    result = {"hook": hook, "path": "native" if native else "python", "ratio": statistics.median(ratios),
              "plain_ms": statistics.median(times["plain"]) * 1e3, "hook_ms": statistics.median(times["hook"]) * 1e3,
              "aten_calls_per_step": {"hook": calls_hook, "plain": calls_plain, "difference": calls_hook - calls_plain,
                                      "hook_executor_thread": calls_executor},
              "hook_buffer_bytes": hooked.buffer_bytes(),
              "grad_bytes": grad_bytes}
    if hooked.state is not None and hasattr(hooked.state, "close"):
        hooked.state.close()
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hooks", default="powersgd")
    parser.add_argument("--paths", default="native,python")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=4, help="steps per loop per round")
    parser.add_argument("--profile-steps", type=int, default=4)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (default 1: a quieter figure)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import torch

    import ddpx

    torch.set_num_threads(args.threads)
    model, batches = setup(args.device)
    results = [measure(hook, path == "native", args, model, batches)
               for hook in args.hooks.split(",") for path in args.paths.split(",")]
    report = {"ddpx": os.path.dirname(ddpx.__file__), "torch": torch.__version__, "device": args.device,
              "threads": args.threads, "rounds": args.rounds, "steps": args.steps, "results": results}
    if not emit(report, args.out, args.json):
        print(f"ddpx from {report['ddpx']}, torch {torch.__version__}, {args.device}, {args.threads} thread(s)")
        for r in results:
            c = r["aten_calls_per_step"]
            print(f"{r['hook']:>9} {r['path']:>6}: step {r['hook_ms']:.1f} ms vs {r['plain_ms']:.1f} without "
                  f"(ratio {r['ratio']:.3f}); operator calls/step {c['hook']:.0f} vs {c['plain']:.0f} "
                  f"(on the hook's executor thread {c['hook_executor_thread']:.0f}); "
                  f"buffers {r['hook_buffer_bytes'] / 1e6:.2f} MB for {r['grad_bytes'] / 1e6:.2f} MB of gradients")
    from ddpx.rank import process_group

    process_group.teardown()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (torch + gloo abort there now and then)


if __name__ == "__main__":
    sys.exit(main())

"""A plugin that records what one rank holds of parameters, gradients and optimizer state
(bytes of its local tensors, the strategy's memory report: its shards under ``trainer.strategy: fsdp``) right after the
process's first optimizer step, and, for benchmarks/bench_sharded.py, when each optimizer step ended,
the bytes its network interfaces had sent by then (``/proc/net/dev``, loopback left out:
what the host sent, in a network namespace per rank what the rank sent), the comm hook's
own counters at the first and the last step, and the process's resident memory at the end
and at its peak. Written at the
end of training into ``run_dir/shard_memory_rank<r>.json``.

Usage (the numbers in docs/sharded.md):
    PYTHONPATH=benchmarks ddpx train examples/char_gpt/config.yaml trainer.max_steps=2 \\
        trainer.strategy=fsdp comm_hook.name=allreduce 'plugins.enable=[shard_memory]'
"""

import json
import resource
import time

from ddpx import hookimpl
from ddpx.plugin.shared import COMM_HOOK

record: dict = {}


def sent_bytes(table: str = "/proc/net/dev"):
    """Bytes sent so far by this network namespace's interfaces other than loopback (None off Linux)."""
    try:
        with open(table) as f:
            lines = f.readlines()[2:]  # two header lines, then "iface: rx_bytes ... tx_bytes ..."
    except OSError:
        return None
    return sum(int(fields.split()[8]) for name, fields in (line.split(":", 1) for line in lines) if name.strip() != "lo")


def resident_bytes():
    """The process's resident memory now (None off Linux): the peak also counts the whole
    model as built, before fsdp shards it."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return None


def hook_stats(trainer):
    hook = trainer.shared.get(COMM_HOOK)
    return hook.stats() if hook is not None else None


@hookimpl(wrapper=True)
def ddpx_optimizer_step(trainer):
    applied = yield  # the gradients are zeroed only after this hook
    if not record:  # this process's first optimizer step (a resumed run's too)
        held = trainer.strategy.memory(trainer.module, trainer.optimizer)
        held["total"] = sum(held.values())
        record.update(held, strategy=trainer.config.trainer.strategy, world_size=trainer.world_size,
                      step_end_s=[], sent_bytes=[], hook_first=hook_stats(trainer))
    record["step_end_s"].append(time.perf_counter())
    record["sent_bytes"].append(sent_bytes())
    return applied


@hookimpl
def ddpx_train_end(trainer):
    if not record:
        return
    record["hook_last"] = hook_stats(trainer)
    record["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    record["rss_bytes"] = resident_bytes()
    (trainer.run_dir / f"shard_memory_rank{trainer.rank}.json").write_text(json.dumps(record))

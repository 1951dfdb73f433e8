"""A plugin that records what one rank holds of parameters, gradients and optimizer state
(bytes of its local tensors: its shards under ``trainer.strategy: fsdp``), right after the
first optimizer step, into ``run_dir/shard_memory_rank<r>.json``.

Usage (the numbers in docs/sharded.md):
    PYTHONPATH=benchmarks ddpx train examples/char_gpt/config.yaml trainer.max_steps=2 \\
        trainer.strategy=fsdp comm_hook.name=allreduce 'plugins.enable=[shard_memory]'
"""

import json

from ddpx import hookimpl
from ddpx.train.fsdp import local_bytes


@hookimpl(wrapper=True)
def ddpx_optimizer_step(trainer):
    applied = yield  # the gradients are zeroed only after this hook
    if trainer.global_step == 0:
        held = local_bytes(trainer.module, trainer.optimizer)
        held["total"] = sum(held.values())
        held["strategy"] = trainer.config.trainer.strategy
        held["world_size"] = trainer.world_size
        (trainer.run_dir / f"shard_memory_rank{trainer.rank}.json").write_text(json.dumps(held))
    return applied

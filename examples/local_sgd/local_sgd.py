"""Local SGD as a ddpx strategy: each rank steps on its own gradients, and every
``local_sgd.every_steps`` optimizer steps the ranks average their weights, one all_reduce
instead of one per step (Lin et al., "Don't Use Large Mini-Batches, Use Local SGD", 2020).

    trainer: {strategy: local_sgd:LocalSGD}     # this file beside the config
    local_sgd: {every_steps: 8}

Checkpoints hold rank 0's replica (``replicated``): a resume starts every rank from it.
"""

import torch
import torch.distributed as dist

from ddpx.errors import DdpxError
from ddpx.strategies import Strategy


class LocalSGD(Strategy):
    config_defaults = {"local_sgd": {"every_steps": 8}}
    compression_advice = "average less often with a larger local_sgd.every_steps"

    @classmethod
    def check_config(cls, values):
        every = values["local_sgd"]["every_steps"]
        if every < 1:
            raise DdpxError(f"local_sgd.every_steps must be >= 1 (optimizer steps between averages), got {every}")

    def wrap(self, trainer, module):
        self.every = self.config.local_sgd.every_steps
        megabytes = sum(p.numel() * p.element_size() for p in module.parameters()) / 1e6
        trainer.log.info(f"local SGD: the weights are averaged every {self.every} optimizer steps "
                         f"({megabytes:.2f} MB a time), the gradients stay on their rank")
        return module  # no DistributedDataParallel: nothing is exchanged during backward

    def start(self, trainer):
        trainer.call_at_step(self.next_average(trainer.global_step), self.average)

    def next_average(self, step):
        return (step // self.every + 1) * self.every

    def average(self, trainer):
        """Every rank, at the same step: the mean of the replicas' weights, one all_reduce per dtype."""
        by_dtype = {}
        for p in trainer.module.parameters():
            by_dtype.setdefault(p.dtype, []).append(p)
        with torch.no_grad():
            for params in by_dtype.values():
                flat = torch.cat([p.reshape(-1) for p in params]).div_(trainer.world_size)
                dist.all_reduce(flat)
                torch._foreach_copy_(params, [f.view_as(p) for f, p in zip(flat.split([p.numel() for p in params]),
                                                                            params)])
        trainer.call_at_step(self.next_average(trainer.global_step), self.average)

    def replica_checks(self, module):
        return {}  # the replicas differ between averages by design

"""``elastic.recovery: live`` with ``trainer.strategy: ddp``: each node is a replica group that
the others train on without when it fails (torchft; ddpx/recovery/).

Inside a group this is the ddp strategy with DDP's own fp32 all-reduce (the links inside a node
are fast). Across the groups, once per step, the configured ``comm_hook.name`` (``allreduce``,
``fp16``, ``bf16``, ``int8``) averages the gradients through the replica groups' manager, and the
optimizer steps only when the step commits (:meth:`commit_step`). The step begins with the
quorum (:meth:`begin_step`), which also lays the epoch out over the groups that train.
"""

from __future__ import annotations

from ..errors import DdpxError
from ..rank.seeding import seed_rank
from .base import EpochMoved
from .ddp import DDPStrategy

__all__ = ["LiveDDPStrategy", "EpochMoved"]


class LiveDDPStrategy(DDPStrategy):
    """DDP inside the replica group, torchft's fault-tolerant exchange across the groups."""

    compression_advice = "compress the exchange across the replica groups with comm_hook.name=fp16, bf16 or int8"

    def __init__(self, config):
        super().__init__(config)
        self.codec = None  # made by use_compression; fp32 allreduce without one
        self.groups = None  # ddpx.recovery.groups.ReplicaGroups, from start()

    @classmethod
    def check_compression(cls, config, method, options):
        from ..recovery.codecs import CODECS

        spec = CODECS.get(method.name)
        if spec is None:
            raise DdpxError(f"comm_hook.name={method.name} cannot cross replica groups under elastic.recovery=live "
                            f"(its memory belongs to a fixed set of ranks); use one of {', '.join(CODECS)}, or "
                            "elastic.recovery=restart")
        unknown = sorted(set(options) - set(spec.options))
        if unknown:
            raise DdpxError(f"comm_hook.options {', '.join(unknown)} do not apply to {method.name} across replica "
                            f"groups (it takes {', '.join(spec.options) or 'none'}); set comm_hook.options={{}}")
        method.check_options({k: v for k, v in options.items() if k in spec.options})

    def use_compression(self, method, options, native):
        from ..recovery.codecs import CODECS

        self.codec = CODECS[method.name].cls(dict(options))  # not on DDP: inside the group DDP averages in fp32

    def install_compression(self, trainer, model):
        trainer.log.info("comm hook %s across the replica groups, once per step (inside a group: DDP's fp32 "
                         "allreduce)", self.codec.name)
        return self.codec  # the comm_hook plugin saves its memory and pairs it with the optimizer

    def start(self, trainer):
        from ..recovery.codecs import Codec
        from ..recovery.groups import ReplicaGroups

        super().start(trainer)
        self.groups = ReplicaGroups(trainer, self.codec or Codec({}))

    def batch_sampler_class(self):
        from ..recovery.sampler import LiveBatchSampler

        return LiveBatchSampler

    def begin_step(self, trainer) -> None:
        from ..recovery.groups import MOVED, RESTART

        outcome = self.groups.begin_step(_sampler(trainer))
        if outcome == MOVED:
            raise EpochMoved()
        if outcome == RESTART:
            trainer.restart_batches()
            # a stream per slot, as ddp's per rank (dropout): a group seeded alike or healed from a
            # peer would otherwise draw the peer's masks
            seed_rank(trainer.config.seed, self.groups.slot, trainer.global_step)

    def commit_step(self, trainer, micro_batches: int) -> bool:
        if not self.groups.commit_step():
            return False
        sampler = _sampler(trainer)
        if sampler is not None:
            sampler.commit(micro_batches)
        return True

    def describe_rank(self, trainer) -> str:
        return "" if self.groups is None else f"replica group {self.groups.name}"


def _sampler(trainer):
    from ..recovery.sampler import LiveBatchSampler

    sampler = getattr(trainer.train_loader, "batch_sampler", None)
    return sampler if isinstance(sampler, LiveBatchSampler) else None

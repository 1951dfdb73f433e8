"""The end of a stream without ``__len__``: every rank ends the epoch at the same step, with no
per-step collective.

An epoch over such a stream lasts until the data runs out. With one rank it ends at once. With
several, a rank whose data ends first (uneven shards) cannot just stop: its peers would wait for
it in their next gradient all_reduce. So it votes "my data ended" in the next stop check's
all_reduce (:class:`~ddpx.train.stopping.StopAgreement`, at the checkpoint plugin's
``stop_check_every``/``stop_check_s`` cadence) and, until the check that reads the vote, fills its
steps with padding passes: forward and backward passes of one of its batches that back-propagate
nothing (:meth:`StreamEnd.pad`). They issue the same collectives as its peers' steps (DDP's,
SyncBatchNorm's) but add no gradient, and are not counted (losses, ``epoch_batches``,
``ddpx_batch_end``). Every rank then ends the epoch after that check (``trainer.num_batches``
becomes the batches it trained): at most two stop-check intervals after the first rank ran out (the automatic interval is at most ``STREAM_STOP_CHECK`` = 10 steps over such a stream). Those
steps are optimizer steps (``global_step``, the LR schedule and ``trainer.max_steps`` count them):
DDP still divides the summed gradient by the world size, so they are scaled by (ranks with data) /
(world size), and where no rank has data left the optimizer steps with zero gradients (momentum
still moves the weights).

At the epoch's start the ranks learn in one all_reduce which of them have a batch at all: a rank
with none (an empty shard, or a resume after it had read all of its data) pads with a batch
borrowed from the first rank that has one; when no rank has one, the epoch ends at once.
"""

from __future__ import annotations

import itertools
import math
from typing import Iterator

import torch
import torch.distributed as dist

from ..errors import DdpxError
from .stopping import STREAM_STOP_CHECK, across_ranks


class StreamEnd:
    """One epoch's end over a stream without ``__len__`` (module docstring)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.across = across_ranks(trainer)
        self.agreement = trainer.stop_agreement
        self.padding = None  # the batch a padding pass reads

    def start(self, batches: Iterator) -> Iterator:
        """The epoch's batches, after the ranks learned who has one (one all_reduce)."""
        trainer = self.trainer
        if self.across and self.agreement is None:
            raise DdpxError(f"the training stream of data.target {trainer.config.data.target} has no __len__, so "
                            "the ranks agree on its end at the checkpoint plugin's stop checks, but that plugin is "
                            "not loaded; remove checkpoint from plugins.block or give the data set a __len__")
        if self.agreement is not None:
            self.agreement.data_ended = False
            self.agreement.most_steps = STREAM_STOP_CHECK  # bounds the padding at the epoch's end
        first = next(batches, None)
        owners = [0] if first is not None else []
        if self.across:
            have = torch.zeros(trainer.world_size, dtype=torch.float64, device=trainer.device)
            have[trainer.rank] = 0.0 if first is None else 1.0
            dist.all_reduce(have)
            owners = [rank for rank, has in enumerate(have.tolist()) if has]
            if owners and len(owners) < trainer.world_size:  # some rank pads from its first step
                box = [first if trainer.rank == owners[0] else None]
                dist.broadcast_object_list(box, src=owners[0])
                self.padding = box[0]
        if not owners:
            if trainer.global_step == 0:
                raise DdpxError(f"the training stream of data.target {trainer.config.data.target} gave no batch in "
                                f"epoch {trainer.epoch}: nothing to train on; check data.args")
            if trainer.is_main:
                trainer.log.warning(f"the training stream of data.target {trainer.config.data.target} has no batch "
                                    f"left in epoch {trainer.epoch} on any rank: the epoch ends with no step (a data "
                                    "set whose __iter__ can run only once gives nothing from its second epoch)")
            self.end_here()
            return iter(())
        if first is not None:
            self.padding = first
            return itertools.chain([first], batches)
        return batches

    def padding_passes(self, batches: int, window: int) -> int:
        """This rank's data ran out with ``batches`` of a ``window``: the padding passes that fill
        it, voted at the next stop check (none with one rank: the epoch ends with this step)."""
        if not self.across:
            self.end_here(batches)
            return 0
        self.agreement.data_ended = True
        return window - batches

    def pad(self, passes: int) -> None:
        """``passes`` forward and backward passes of the padding batch with no gradient, the
        window's last outside ``no_sync``: the collectives of a step, nothing trained."""
        trainer = self.trainer
        for i in range(passes):
            if i < passes - 1 and trainer._unsynced is not None:
                with trainer._unsynced():  # the trainer's no_sync (DDP) or set_requires_gradient_sync (FSDP)
                    trainer.forward_backward(self.padding, window=math.inf)
            else:
                trainer.forward_backward(self.padding, window=math.inf)

    def end_here(self, pending: int = 0) -> None:
        """The epoch ends after this rank's ``pending`` batches (every rank ends it at the same step)."""
        self.trainer.num_batches = self.trainer.epoch_batches + pending

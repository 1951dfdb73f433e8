"""The training sampler of a live run: an epoch divided over the replica groups that train now.

It lays out an epoch as :class:`~ddpx.data.sampler.ResumableDistributedBatchSampler` does (one
shuffled order per epoch, identical everywhere; a position ``consumed`` in it), with one slot per
rank of every participating group: ``slots = groups x ranks per group``, this rank's slot
``group's place in the quorum x ranks per group + its rank in the group``. Each step, every slot
takes its piece of the next global batch of ``slots x batch_size`` samples from ``consumed``.

What moves the position is a committed step, not the loader: :meth:`LiveBatchSampler.commit`
(the replica groups' manager said the step counts). A step that is dropped moves nothing, so its
samples are trained again by the next step, by whichever groups train then; a membership change
re-lays the rest of the epoch over the new slots from the same position. Within an epoch, therefore,
every sample is trained exactly once in the committed steps (the tail rule is the base sampler's:
a tail smaller than the slots is folded into the last global batch). A group that heals takes the
position with the rest of the state.
"""

from __future__ import annotations

from ..data.sampler import ResumableDistributedBatchSampler


class LiveBatchSampler(ResumableDistributedBatchSampler):
    """Slots over the participating replica groups; the position moves on commits only."""

    def place(self, slot: int, slots: int) -> bool:
        """This rank's ``slot`` of ``slots`` for the coming steps; True when that changed."""
        changed = (slot, slots) != (self.rank, self.world_size)
        self.rank, self.world_size = int(slot), int(slots)
        return changed

    def advance(self, batches: int = 1) -> None:
        """Nothing: the sampler plugin advances by batches trained, which under live recovery are
        not what moves the epoch (:meth:`commit` is)."""

    def commit(self, batches: int) -> None:
        """A step of ``batches`` micro-batches per slot was committed by the replica groups."""
        super().advance(batches)

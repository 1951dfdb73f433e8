"""Samplers that shard data across ranks.

``ResumableDistributedBatchSampler`` shards the training set so that the
position in an epoch is a single integer and can be restored with any world
size. ``ShardSampler`` shards the evaluation set into contiguous pieces with no
padding, so no sample is counted twice in a metric.

Layout of one epoch (``N`` samples, ``W`` ranks, ``B`` samples per rank and batch):

* the epoch's global order is ``torch.randperm(N)`` seeded with ``seed + epoch``
  (``arange(N)`` without shuffling): identical on every rank;
* starting at position ``consumed``, the remaining order is cut into *global
  batches*: contiguous slices of ``W * B`` samples; rank ``r`` takes the
  contiguous piece ``[r * S // W, (r + 1) * S // W)`` of a global batch of size
  ``S`` (exactly ``B`` for a full one);
* the tail (fewer than ``W * B`` samples) is one more, smaller global batch,
  divided by the same formula (ranks differ by at most one sample); a tail of
  fewer than ``W`` samples cannot give every rank a sample, so it is folded into
  the previous global batch (then ranks get ``B`` or ``B + 1``). If the whole
  remainder of the epoch is fewer than ``W`` samples, it is skipped: it cannot
  be split without duplicates. With ``drop_last`` the tail is dropped;
* every rank therefore yields the same number of batches (DDP never waits for a
  rank that ran out), and the samples consumed after ``k`` batches are exactly
  a prefix of the epoch order: ``consumed`` is the whole position.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Mapping, Optional

import torch
from torch.utils.data import Sampler

from ..errors import DdpxError


class ResumableDistributedBatchSampler(Sampler[List[int]]):
    """Batch sampler for DDP training whose position survives restarts.

    Use it as ``DataLoader(dataset, batch_sampler=sampler)``. Call
    :meth:`set_epoch` before each epoch and :meth:`advance` after each batch
    has been trained on (not when the loader prefetches it); the sampler
    plugin does both. :meth:`state_dict` / :meth:`load_state_dict` save and
    restore the position, also into a run with a different world size.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        rank: int,
        world_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        with_epoch: bool = False,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.num_samples = int(num_samples)
        self.batch_size = int(batch_size)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.with_epoch = bool(with_epoch)  # yield (epoch, index) keys (for ddpx.data.seeded.SeededDataset)
        self.epoch = 0
        self.consumed = 0

    # --- position ---------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order. A new epoch starts at position 0; setting
        the current epoch again keeps the position (a resumed run)."""
        epoch = int(epoch)
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed = 0

    def advance(self, batches: int = 1) -> None:
        """Mark the next ``batches`` global batches as consumed (trained on)."""
        for _ in range(batches):
            end = self._next_end(self.consumed)
            if end is None:
                raise RuntimeError(
                    f"sampler advanced past the end of epoch {self.epoch} "
                    f"(consumed {self.consumed} of {self.num_samples} samples)"
                )
            self.consumed = end

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict` (any world size)."""
        if int(state["num_samples"]) != self.num_samples:
            raise DdpxError(
                f"the checkpoint's sampler was over {state['num_samples']} training samples "
                f"but the data set now has {self.num_samples}; resume with the same data "
                "or start a new run (checkpoint.resume=false)"
            )
        consumed = int(state["consumed"])
        if not 0 <= consumed <= self.num_samples:
            raise DdpxError(f"invalid sampler position {consumed} in checkpoint")
        self.seed = int(state["seed"])  # the order the position refers to
        self.epoch = int(state["epoch"])
        self.consumed = consumed

    # --- layout -------------------------------------------------------------------------

    def epoch_order(self) -> torch.Tensor:
        """The global order of the current epoch (identical on every rank)."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=generator)

    def _next_end(self, start: int) -> Optional[int]:
        """End of the global batch starting at ``start`` (None: the epoch is over).
        O(1): called after every batch. The rule is in the module docstring."""
        per_step = self.world_size * self.batch_size
        full, tail = divmod(self.num_samples - start, per_step)
        keep_tail = tail > 0 and not self.drop_last
        if full == 0:
            return self.num_samples if keep_tail and tail >= self.world_size else None
        if full == 1 and keep_tail and tail < self.world_size:
            return self.num_samples  # the last full batch takes the short tail
        return start + per_step

    def epoch_batches(self) -> int:
        """Batches of a whole epoch (from position 0)."""
        full, tail = divmod(self.num_samples, self.world_size * self.batch_size)
        return full + (1 if tail >= self.world_size and not self.drop_last else 0)

    def __len__(self) -> int:
        """Batches left in this epoch from the current position (same on every rank)."""
        full, tail = divmod(self.num_samples - self.consumed, self.world_size * self.batch_size)
        return full + (1 if tail >= self.world_size and not self.drop_last else 0)

    def __iter__(self) -> Iterator[List[int]]:
        order = self.epoch_order()
        begin = self.consumed
        end = self._next_end(begin)
        while end is not None:
            size = end - begin
            lo = begin + self.rank * size // self.world_size
            hi = begin + (self.rank + 1) * size // self.world_size
            batch = order[lo:hi].tolist()
            yield [(self.epoch, i) for i in batch] if self.with_epoch else batch
            begin, end = end, self._next_end(end)


def shard_range(num_samples: int, rank: int, world_size: int) -> range:
    """Rank ``rank``'s contiguous shard of ``range(num_samples)``: sizes differ
    by at most one, no index is repeated (a rank may get none if there are
    fewer samples than ranks)."""
    return range(rank * num_samples // world_size, (rank + 1) * num_samples // world_size)


class ShardSampler(Sampler[int]):
    """Sequential sampler over this rank's contiguous shard (evaluation: no
    padding, so metrics reduced as sums over ranks count each sample once)."""

    def __init__(self, num_samples: int, rank: int, world_size: int):
        self.indices = shard_range(num_samples, rank, world_size)

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

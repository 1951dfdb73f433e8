"""Streaming data: an ``IterableDataset`` sharded across ranks and DataLoader workers.

The rule. The stream must say how many samples one epoch has (``__len__``). Of
the epoch's samples (numbered ``i = 0, 1, ...`` in the order the dataset yields
them), rank ``r`` of ``W`` takes those with ``i % W == r``; within a rank,
DataLoader worker ``w`` of ``K`` takes every ``K``-th of the rank's samples,
starting at its ``w``-th. So each sample is read by every rank's workers but
trained on once per epoch. A dataset that shards itself (it reads
``torch.distributed`` and ``get_worker_info()``) sets ``ddpx_shards_itself =
True`` and is iterated as it is; its ``__len__`` is then the samples of one
rank.

Same number of steps on every rank, with no collective: every rank computes the
batches of every rank from ``__len__``, ``W``, ``K`` and the batch size (a
worker's last batch may be short) and stops each epoch after the smallest
count. The samples past it (fewer than ``K`` batches per rank) are not trained
that epoch.

Resume: the stream is read again from the start of the interrupted epoch and
the batches already trained are skipped (read, not trained), so the run goes on
exactly after them, augmentations included (workers are seeded per epoch,
:mod:`ddpx.rank.seeding`). Reading them again costs up to one epoch's I/O; nothing
is trained twice.
"""

from __future__ import annotations

import itertools
from typing import Optional

from torch.utils.data import IterableDataset, get_worker_info

from ..errors import DdpxError
from ..rank.seeding import derive_seed, seed_everything


def stream_length(dataset, target: str) -> int:
    try:
        return int(len(dataset))
    except TypeError:
        raise DdpxError(f"the streaming data set of data.target {target} ({type(dataset).__name__}) has no __len__: "
                        "define __len__ as the number of samples in one epoch, so every rank runs the same number "
                        "of steps (docs/config.md, Streaming data)") from None


def batches_per_rank(samples: int, rank: int, world_size: int, workers: int, batch_size: int,
                     shards_itself: bool = False) -> int:
    """Batches rank ``rank`` gets in one epoch under the rule above (workers' last batches may be short)."""
    mine = samples if shards_itself else len(range(rank, samples, world_size))
    return sum(-(-len(range(w, mine, workers)) // batch_size) for w in range(workers))


class ShardedStream(IterableDataset):
    """Rank ``rank``'s share of ``dataset``, split among the DataLoader workers (rule above)."""

    def __init__(self, dataset, rank: int, world_size: int, seed: int, per_sample: bool = False):
        self.dataset = dataset
        self.rank, self.world_size, self.seed, self.per_sample = rank, world_size, seed, per_sample
        self.epoch = 0
        self._iterations = 0  # epochs this copy iterated (a persistent worker's copy counts its own)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._iterations = int(epoch), 0

    def __iter__(self):
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        epoch = self.epoch + self._iterations if info is not None else self.epoch
        self._iterations += 1
        if info is not None and not self.per_sample:
            seed_everything(derive_seed(self.seed, self.rank, worker, epoch))
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        if getattr(self.dataset, "ddpx_shards_itself", False):
            yield from self.dataset
            return
        mine = itertools.islice(enumerate(self.dataset), self.rank, None, self.world_size)
        for index, sample in itertools.islice(mine, worker, None, workers):
            if self.per_sample:
                seed_everything(derive_seed(self.seed, epoch, index))
            yield sample


class StreamLoader:
    """What the trainer iterates for a stream: the DataLoader cut to the epoch's agreed
    number of batches, the batches a checkpoint already trained skipped."""

    def __init__(self, loader, stream: ShardedStream, steps: int):
        self.loader, self.stream, self.steps = loader, stream, steps
        self.dataset = stream.dataset
        self.epoch, self.consumed = 0, 0  # batches of the epoch trained (kept by the sampler plugin)
        self._skip = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.consumed = int(epoch), 0
        self.stream.set_epoch(self.epoch)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "steps": self.steps}

    def load_state_dict(self, state: dict, log=None) -> None:
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        if int(state.get("steps", self.steps)) != self.steps:
            raise DdpxError(f"the checkpoint's stream had {state['steps']} steps per epoch, now {self.steps} (other "
                            "data, batch size, workers or ranks); resume with the same ones or set "
                            "checkpoint.resume=false")
        self.stream.set_epoch(self.epoch)
        if self.consumed and log is not None:
            log.info(f"streaming data: reading past the {self.consumed} batches of epoch {self.epoch} "
                     "already trained (not trained again)")

    def __len__(self) -> int:
        return self.steps - self.consumed

    def __iter__(self):
        batches = iter(self.loader)
        for _ in range(self.consumed):
            next(batches, None)
        yield from itertools.islice(batches, self.steps - self.consumed)

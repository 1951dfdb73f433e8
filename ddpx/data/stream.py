"""Streaming data: an ``IterableDataset`` sharded across ranks and DataLoader workers.

Sharding. Of an epoch's samples (numbered ``i = 0, 1, ...`` in the order the
dataset yields them), rank ``r`` of ``W`` takes those with ``i % W == r``;
within a rank, DataLoader worker ``w`` of ``K`` takes every ``K``-th of the
rank's samples, starting at its ``w``-th. So each sample is trained once per
epoch, but every rank's workers read the whole stream (a one-time note says
so). A dataset that reads only its own part sets ``ddpx_shards_itself = True``
and is iterated as it is: it finds its part with :func:`stream_shard` (or
from ``torch.distributed`` and ``get_worker_info()``, as webdataset's
``split_by_node``/``split_by_worker`` and Hugging Face's
``split_dataset_by_node`` do). A dataset with ``set_epoch(epoch)`` is told the
epoch before each pass.

With ``__len__`` (the samples of one epoch; of one rank for a dataset that
shards itself), every rank computes the batches of every rank from
``__len__``, ``W``, ``K`` and the batch size (a worker's last batch may be
short) and stops each epoch after the smallest count, with no collective. The
samples past it (fewer than ``K`` batches per rank) are not trained that epoch.

Without ``__len__`` (a generator, a Hugging Face streaming set, a webdataset
pipeline) an epoch lasts until the stream runs out, possibly never
(``trainer.max_steps`` then ends the run). The ranks agree on the end at their
stop checks (:mod:`ddpx.train.stopping`), with no per-step collective; a rank
whose data ended first keeps DDP's collectives in step with passes of one of
its batches that back-propagate nothing until then (:mod:`ddpx.train.stream_end`).
A Hugging Face or webdataset stream splits itself among DataLoader workers, so
with more than one worker it must shard itself (:func:`check_worker_split`).

Resume: the stream is read again from the start of the interrupted epoch and
each rank skips the batches it already trained (read, not trained), so the run
goes on exactly after them, augmentations included (workers are seeded per
epoch, :mod:`ddpx.rank.seeding`). Reading them again costs up to one epoch's
I/O (for an unbounded stream: everything read since the run started); nothing
is trained twice. A stream without ``__len__`` resumed with another number of
ranks or workers cannot find its place: the epoch starts again from its
beginning (with a warning).
"""

from __future__ import annotations

import itertools
from typing import Optional

import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from ..errors import DdpxError
from ..rank.seeding import derive_seed, seed_everything

_place: Optional[tuple] = None  # (rank, world_size) of the ShardedStream iterating in this process


def stream_shard() -> tuple:
    """``(part, parts)``: the part of the stream this process reads, for a dataset with
    ``ddpx_shards_itself = True`` (call it in its ``__iter__``): ``parts`` is ranks x
    DataLoader workers, ``part`` is ``rank * workers + worker``. Read sample ``i`` when
    ``i % parts == part``, or file ``files[part::parts]``."""
    if _place is not None:
        rank, world_size = _place
    elif dist.is_available() and dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        rank, world_size = 0, 1
    info = get_worker_info()
    workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
    return rank * workers + worker, world_size * workers


WORKER_SPLITTING = ("datasets", "webdataset")  # packages whose streams split among DataLoader workers on their own


def check_worker_split(dataset, target: str, workers: int) -> None:
    """A Hugging Face or webdataset stream splits itself among DataLoader workers: split again by
    ddpx, each worker would train a fraction of its part. Such a stream must shard itself."""
    package = type(dataset).__module__.split(".")[0]
    if workers > 1 and package in WORKER_SPLITTING and not getattr(dataset, "ddpx_shards_itself", False):
        raise DdpxError(f"data.target {target} returned a {package} {type(dataset).__name__}, which splits itself "
                        "among DataLoader workers, so ddpx must not split it again: split it among ranks too "
                        "(datasets.distributed.split_dataset_by_node, or webdataset's nodesplitter=split_by_node) and "
                        "set ddpx_shards_itself = True on it, or set trainer.num_workers=1 (docs/config.md, "
                        "Streaming data)")


def has_length(dataset) -> bool:
    """Whether ``len(dataset)`` works (a stream without it ends when its data does)."""
    try:
        len(dataset)
    except TypeError:
        return False
    return True


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
        global _place
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        epoch = self.epoch + self._iterations if info is not None else self.epoch
        self._iterations += 1
        if info is not None and not self.per_sample:
            seed_everything(derive_seed(self.seed, self.rank, worker, epoch))
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        if getattr(self.dataset, "ddpx_shards_itself", False):
            _place = (self.rank, self.world_size)  # for stream_shard() in the dataset's __iter__
            yield from self.dataset
            return
        mine = itertools.islice(enumerate(self.dataset), self.rank, None, self.world_size)
        for index, sample in itertools.islice(mine, worker, None, workers):
            if self.per_sample:
                seed_everything(derive_seed(self.seed, epoch, index))
            yield sample


class StreamLoader:
    """What the trainer iterates for a stream without ``__len__``: the DataLoader, the batches
    this rank already trained in the epoch skipped (a resume); the epoch ends when the data does."""

    def __init__(self, loader, stream: ShardedStream, workers: int):
        self.loader, self.stream, self.workers = loader, stream, workers
        self.dataset = stream.dataset
        self.epoch, self.consumed = 0, 0  # batches of the epoch this rank trained (kept by the sampler plugin)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.consumed = int(epoch), 0
        self.stream.set_epoch(self.epoch)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "world_size": self.stream.world_size,
                "workers": self.workers}

    def load_state_dict(self, state: dict, log=None) -> None:
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        then = (int(state.get("world_size", self.stream.world_size)), int(state.get("workers", self.workers)))
        if then != (self.stream.world_size, self.workers):
            if log is not None and self.stream.rank == 0:
                log.warning(f"streaming data: the checkpoint's stream was split among {then[0]} ranks x {then[1]} "
                            f"workers, now {self.stream.world_size} x {self.workers}: its place cannot be found, so "
                            f"epoch {self.epoch} starts again from its beginning (its batches trained before the "
                            "checkpoint are trained again)")
            self.consumed = 0
        self.stream.set_epoch(self.epoch)
        if self.consumed and log is not None:
            log.info(f"streaming data: epoch {self.epoch}'s stream is read again from its start and each rank skips "
                     f"the batches it already trained (rank {self.stream.rank}: {self.consumed}), not trained again")

    def __iter__(self):
        batches = iter(self.loader)
        for _ in range(self.consumed):
            next(batches, None)
        yield from batches


class CountedStreamLoader(StreamLoader):
    """A stream with ``__len__``: the DataLoader cut to the epoch's agreed number of batches."""

    def __init__(self, loader, stream: ShardedStream, workers: int, steps: int):
        super().__init__(loader, stream, workers)
        self.steps = steps

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
        yield from itertools.islice(super().__iter__(), self.steps - self.consumed)

"""The training set as the sampler plugin's loader reads it: seeds per worker and epoch, or per sample.

The batch sampler yields ``(epoch, index)`` keys (``with_epoch=True``), so the
dataset, even in a persistent DataLoader worker, knows the epoch of each sample
(rules in :mod:`ddpx.rank.seeding`):

* in a worker, the first sample of an epoch reseeds the worker's generators
  from ``(seed, rank, worker, epoch)``; in the main process (``num_workers: 0``)
  loading draws from the rank's own stream;
* with ``per_sample``, every sample is loaded under generators seeded from
  ``(seed, epoch, index)``; in the main process the rank's stream is put back
  afterwards, so dropout draws do not depend on the data.
"""

from __future__ import annotations

import random
import sys

import torch
from torch.utils.data import Dataset, get_worker_info

from ..rank.seeding import derive_seed, seed_everything


class SeededDataset(Dataset):
    def __init__(self, dataset, seed: int, rank: int, per_sample: bool = False):
        self.dataset = dataset
        self.seed, self.rank, self.per_sample = int(seed), int(rank), bool(per_sample)
        self._epoch = None  # the epoch this worker last reseeded for

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key):
        epoch, index = key
        worker = get_worker_info()
        if self.per_sample:
            if worker is not None:
                seed_everything(derive_seed(self.seed, epoch, index))
                return self.dataset[index]
            with _rank_stream_kept():
                seed_everything(derive_seed(self.seed, epoch, index))
                return self.dataset[index]
        if worker is not None and self._epoch != epoch:
            self._epoch = epoch
            seed_everything(derive_seed(self.seed, self.rank, worker.id, epoch))
        return self.dataset[index]

    def __getitems__(self, keys: list) -> list:
        """A batch's samples: the DataLoader's fetch calls this once per batch."""
        if self.per_sample or get_worker_info() is not None:
            return [self[key] for key in keys]
        return [self.dataset[index] for _, index in keys]  # the main process draws from the rank's stream


class _rank_stream_kept:
    """Put the process's torch CPU, Python and NumPy generator states back on exit."""

    def __enter__(self):
        self.torch, self.python = torch.get_rng_state(), random.getstate()
        self.numpy = sys.modules["numpy"].random.get_state() if "numpy" in sys.modules else None

    def __exit__(self, *exc):
        torch.set_rng_state(self.torch)
        random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)
        return False

"""Random streams: the same initial weights everywhere, then one stream per rank.

The rule (``seed`` is the config's ``seed``):

* model construction: every rank seeds with ``seed`` itself, so the initial
  weights are identical on every rank (DDP also broadcasts rank 0's);
* after set-up, each rank's torch (CPU and CUDA), Python ``random`` and NumPy
  global generators are seeded from ``(seed, rank)``: dropout masks and random
  draws in ``forward`` differ across ranks and are the same in every run;
* a DataLoader worker of the training loader reseeds its generators from
  ``(seed, rank, worker, epoch)`` at the first sample it loads in an epoch;
* with ``trainer.seed_per_sample: true`` each training sample is loaded under
  generators seeded from ``(seed, epoch, sample index)``: its augmentation does
  not depend on the rank, the worker or the world size.

Checkpoints save each rank's generator states and a resume restores them
(:func:`ddpx.rank.checkpoint_files.rng_state`); a resume with another world size reseeds
each rank from ``(seed, rank, step)``.
"""

from __future__ import annotations

import hashlib
import random
import sys

import torch


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that depends on every part (a hash: nearby inputs give unrelated seeds)."""
    text = ",".join(str(int(p)) for p in parts)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and every CUDA device), Python ``random`` and, if imported, NumPy."""
    torch.manual_seed(seed)
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed % 2**32)


def seed_rank(seed: int, rank: int, *more: int) -> None:
    """This rank's own stream, from ``(seed, rank, *more)``."""
    seed_everything(derive_seed(seed, rank, *more))

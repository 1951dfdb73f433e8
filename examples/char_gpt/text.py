"""Character data from a text file: every window of ``block_size + 1`` characters
of the first ``1 - val_fraction`` of the text is a training sample (input and the
input shifted by one); the rest is cut into non-overlapping validation windows.
Batches are dicts ``{"idx", "targets"}``, the model's keyword arguments."""

import math
import os

import torch
from torch.utils.data import Dataset

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "sonnets.txt")  # Shakespeare's sonnets (1609), public domain


class Windows(Dataset):
    def __init__(self, ids: torch.Tensor, block_size: int, stride: int):
        self.ids, self.block_size, self.stride = ids, block_size, stride

    def __len__(self):
        return (len(self.ids) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i):
        chunk = self.ids[i * self.stride:i * self.stride + self.block_size + 1]
        return {"idx": chunk[:-1], "targets": chunk[1:]}


def encode(path: str = TEXT) -> tuple[torch.Tensor, str]:
    """The text as character ids (a byte-valued vocabulary: ids are code points < 128)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    ids = torch.tensor([ord(c) for c in text], dtype=torch.long)
    if ids.max() >= 128:
        raise ValueError(f"{path} has non-ASCII characters; this example's vocabulary is ASCII")
    return ids, text


def splits(path: str = TEXT, block_size: int = 64, val_fraction: float = 0.1):
    ids, _ = encode(path)
    cut = int(len(ids) * (1 - val_fraction))
    return Windows(ids[:cut], block_size, stride=1), Windows(ids[cut:], block_size, stride=block_size)


def unigram_loss(path: str = TEXT, val_fraction: float = 0.1) -> float:
    """The validation cross-entropy (nats/char) of the training text's character
    frequencies: the baseline a model that ignores context reaches."""
    ids, _ = encode(path)
    cut = int(len(ids) * (1 - val_fraction))
    counts = torch.bincount(ids[:cut], minlength=128).double() + 1  # add-one: unseen characters
    log_p = (counts / counts.sum()).log()
    return -log_p[ids[cut:]].mean().item()


if __name__ == "__main__":
    print(f"unigram baseline: {unigram_loss():.4f} nats/char ({unigram_loss() / math.log(2):.3f} bits)")

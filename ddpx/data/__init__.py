"""Built-in data: the UCI handwritten digits (1797 8x8 images, 10 classes).

The CSV ships inside the package (the copy scikit-learn distributes; UCI ML
hand-written digits, CC BY 4.0), so the default example and the convergence
tests need no download and no scikit-learn.
"""

import gzip
import os

import torch

_DIGITS = os.path.join(os.path.dirname(__file__), "digits.csv.gz")


def load_digits():
    """Return ``(images, labels)``: float32 [1797, 64] scaled to [0, 1], int64 [1797]."""
    with gzip.open(_DIGITS, "rt") as f:
        rows = [list(map(float, line.split(","))) for line in f if line.strip()]
    data = torch.tensor(rows, dtype=torch.float32)
    return data[:, :64] / 16.0, data[:, 64].to(torch.int64)


def digits_split(test_fraction=0.2, seed=0):
    """Deterministic train/test split of the digits: ``(train, test)`` TensorDatasets."""
    x, y = load_digits()
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(y), generator=g)
    n_test = int(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    ds = torch.utils.data.TensorDataset
    return ds(x[train], y[train]), ds(x[test], y[test])

"""The micro-batch losses of the running epoch, kept as device tensors.

The loop appends each micro-batch's detached loss; nothing is summed or read
on the host per step. Sums are taken (in float64, on the device) only when
someone asks: the epoch end, and the :class:`LossWindow` readers (the logging
plugin's step lines and bar, the checkpoint plugin's non-finite check). Each
loss is stacked once, however many windows read it.
"""

from __future__ import annotations

from typing import Optional

import torch

FOLD_AT = 4096  # losses kept as separate tensors before they are summed into one


class EpochLosses:
    def __init__(self):
        self.pending: list = []  # detached losses not yet summed
        self.sum: Optional[torch.Tensor] = None  # the epoch's summed losses (float64)
        self.summed = 0  # micro-batches in ``sum``
        self.windows: list[LossWindow] = []

    def start_epoch(self) -> None:
        self.fold()  # windows span epochs
        self.sum, self.summed = None, 0

    def append(self, loss: torch.Tensor) -> None:
        self.pending.append(loss)
        if len(self.pending) == FOLD_AT:  # bound the memory of very long epochs
            self.fold()

    def fold(self) -> None:
        """Sum the pending losses into the epoch total and every open window."""
        pending = self.pending
        if not pending:
            return
        stacked = torch.stack(pending).double()
        for window in self.windows:
            window._fold(stacked)
        part = stacked.sum()
        self.sum = part if self.sum is None else self.sum + part
        self.summed += len(pending)
        pending.clear()

    def epoch_total(self) -> tuple[Optional[torch.Tensor], int]:
        """``(sum of the epoch's losses as a float64 tensor or None, micro-batches)``."""
        self.fold()
        return self.sum, self.summed

    def open_window(self) -> "LossWindow":
        window = LossWindow(self)
        self.windows.append(window)
        return window


class LossWindow:
    """The micro-batch losses since the previous :meth:`take` (or since the window
    was opened), across epochs, summed exactly on the device: no host sync, no
    per-step work."""

    def __init__(self, losses: EpochLosses):
        self._losses = losses
        self._sum: Optional[torch.Tensor] = None
        self._count = 0
        self._start = len(losses.pending)  # the first pending loss that belongs here

    @property
    def pending(self) -> int:
        """Micro-batches in the window so far (no tensor work)."""
        return self._count + len(self._losses.pending) - self._start

    def _fold(self, stacked: torch.Tensor) -> None:
        """The pending losses (all of them ``stacked``) are being summed."""
        if self._start < len(stacked):
            mine = stacked[self._start:]
            part = mine.sum()
            self._sum = part if self._sum is None else self._sum + part
            self._count += len(mine)
        self._start = 0

    def take(self) -> tuple[Optional[torch.Tensor], int]:
        """``(sum of the losses as a float64 tensor, or None, number of micro-batches)``
        since the previous take; the window then starts again, empty."""
        self._losses.fold()
        taken = self._sum, self._count
        self._sum, self._count = None, 0
        return taken

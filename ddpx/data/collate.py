"""``data.collate: module.function``: how samples become a batch, with one-line errors.

A collate function that raises (the default one on samples of different
shapes, say) ends the run with one line naming the key to set or the function
that failed, also when it ran in a DataLoader worker.
"""

from __future__ import annotations

from typing import Callable, Optional

from torch.utils.data import default_collate

from ..errors import DdpxError


class CollateError(DdpxError):
    """A batch could not be collated. Torch re-raises a worker's exception in the main
    process as ``CollateError("Caught CollateError in DataLoader worker ...\\n<traceback>")``:
    the message is cut back to its one line."""

    def __init__(self, message: str):
        if message.startswith("Caught CollateError"):
            last = [line for line in message.splitlines() if line.strip()][-1]
            message = last.split("CollateError: ", 1)[-1]
        super().__init__(message)


class Collate:
    """The loader's collate function: ``fn`` (``data.collate``, resolved; None: torch's
    default) with one-line errors. Workers get a pickled copy (``fn`` by reference)."""

    def __init__(self, target: Optional[str] = None, fn: Optional[Callable] = None):
        self.target = target
        self.fn: Callable = fn if fn is not None else default_collate

    def __call__(self, samples):
        try:
            return self.fn(samples)
        except Exception as exc:
            first = (str(exc).splitlines() or [""])[0][:200]
            if self.target:
                raise CollateError(f"data.collate {self.target} failed on a batch of {len(samples)} samples: "
                                   f"{type(exc).__name__}: {first}") from None
            raise CollateError(f"cannot collate a batch of {len(samples)} samples ({type(exc).__name__}: {first}); "
                               "samples of different sizes need data.collate: module.function (e.g. padding)") from None

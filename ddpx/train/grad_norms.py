"""The total gradient norm of an optimizer step, without a host sync."""

from __future__ import annotations

from typing import Optional

import torch


class GradientNorms:
    """The total gradient norm of an optimizer step, and the first parameter whose
    gradient went non-finite (for the non-finite guard's message).

    :meth:`compute` takes one ``_foreach_norm`` per (device, dtype) group, as
    ``clip_grad_norm_`` does, and keeps the per-parameter norms: the earliest
    (step, parameter) with a non-finite norm is folded into one device integer,
    ``step * P + index``, so tracking it costs a few tiny kernels and no host
    sync; :meth:`first_nonfinite` reads it once, when the guard fires."""

    NONE = torch.iinfo(torch.int64).max

    def __init__(self, module: torch.nn.Module):
        self.named = list(module.named_parameters())
        self.first = None  # device int64: step * len(named) + index, or NONE
        self.positions: dict = {}  # tuple of parameter indices -> their device tensor (cached)

    def compute(self, step: int, track: bool = True) -> torch.Tensor:
        """The total 2-norm of the gradients now (a 0-dim device tensor; gradients
        of several dtypes are summed in fp32) at optimizer step ``step``."""
        groups: dict = {}
        for index, (_, p) in enumerate(self.named):
            if p.grad is not None:
                groups.setdefault((p.grad.device, p.grad.dtype), []).append((index, p.grad))
        if not groups:
            return torch.zeros(())
        device = next(iter(groups))[0]
        order = tuple(i for group in groups.values() for i, _ in group)
        norms = torch.cat([torch.stack(torch._foreach_norm([g for _, g in group])).to(device, torch.float32)
                           for group in groups.values()])
        total = torch.linalg.vector_norm(norms)
        if track:
            positions = self.positions.get(order)
            if positions is None:
                positions = self.positions[order] = torch.tensor(order, dtype=torch.int64, device=device)
            keys = torch.where(norms.isfinite(), self.NONE, positions + step * len(self.named))
            self.first = keys.min() if self.first is None else torch.minimum(self.first, keys.min())
        return total

    def first_nonfinite(self) -> Optional[tuple]:
        """``(parameter name, optimizer step)`` of the first non-finite gradient seen, or None."""
        if self.first is None:
            return None
        key = int(self.first.item())
        if key == self.NONE:
            return None
        step, index = divmod(key, len(self.named))
        return self.named[index][0], step

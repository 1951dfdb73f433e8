"""The total gradient norm of an optimizer step, without a host sync."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist



class GradientNorms:
    """The total gradient norm of an optimizer step, and the first parameter whose
    gradient went non-finite (for the non-finite guard's message).

    :meth:`compute` takes one ``_foreach_norm`` per (device, dtype) group, as
    ``clip_grad_norm_`` does, and keeps the per-parameter norms: the earliest
    (step, parameter) with a non-finite norm is folded into one device integer,
    ``step * P + index``, so tracking it costs a few tiny kernels and no host
    sync; :meth:`first_nonfinite` reads it once, when the guard fires.

    Gradients split over ranks (the strategy's :meth:`~ddpx.strategies.Strategy.part_reduction`:
    fsdp's shards): each rank holds a part of such a gradient, so the norms are taken over
    the local parts and their squares summed across the ranks holding the parts (one
    all_reduce per computed norm, on every rank): the total is the global norm, each
    gradient counted once, the same on every rank; ``collective`` is then True."""

    NONE = torch.iinfo(torch.int64).max

    def __init__(self, module: torch.nn.Module, strategy):
        self.named = list(module.named_parameters())  # after the wrap: FSDP replaces the parameters
        self.strategy = strategy
        self.parts = strategy.part_reduction(module)  # None: whole gradients on every rank
        self.collective = self.parts is not None
        # Where the norms are summed: the strategy's collectives' device (fsdp.offload=cpu keeps the
        # gradients on the CPU).
        self.device = self.parts.device if self.parts is not None else None
        self.first = None  # device int64: step * len(named) + index, or NONE
        self.positions: dict = {}  # tuple of parameter indices -> their device tensors (cached)

    def compute(self, step: int, track: bool = True) -> torch.Tensor:
        """The total 2-norm of the gradients now (a 0-dim device tensor; gradients
        of several dtypes are summed in fp32) at optimizer step ``step``."""
        groups: dict = {}
        for index, (_, p) in enumerate(self.named):
            if p.grad is not None:
                grad = self.strategy.local(p.grad)
                groups.setdefault((grad.device, grad.dtype), []).append((index, grad))
        if not groups and not self.collective:
            return torch.zeros(())
        device = self.device or (next(iter(groups))[0] if groups else self.named[0][1].device)
        order = tuple(i for group in groups.values() for i, _ in group)
        norms = torch.cat([torch.stack(torch._foreach_norm([g for _, g in group])).to(device, torch.float32)
                           for group in groups.values()]) if groups else torch.zeros(0, device=device)
        positions, part_mask, shares = self._positions(order, device)
        if self.collective:  # the local parts' squares, summed over the ranks; whole gradients counted once
            squares = norms.square()
            total_sq = (squares * shares)[part_mask].sum() if shares is not None else squares[part_mask].sum()
            self.parts.reduce(total_sq, dist.ReduceOp.SUM)
            total = (total_sq + squares[~part_mask].sum()).sqrt()
        else:
            total = torch.linalg.vector_norm(norms)
        if track and len(order):
            keys = torch.where(norms.isfinite(), self.NONE, positions + step * len(self.named))
            self.first = keys.min() if self.first is None else torch.minimum(self.first, keys.min())
        return total

    def _positions(self, order: tuple, device) -> tuple:
        cached = self.positions.get(order)
        if cached is None:
            positions = torch.tensor(order, dtype=torch.int64, device=device)
            mask = torch.tensor([self.collective and self.parts.holds_part(self.named[i][1]) for i in order],
                                dtype=torch.bool, device=device)
            share = self.parts.share if self.collective else None
            shares = None if share is None else \
                torch.tensor([share(self.named[i][1]) for i in order], dtype=torch.float32, device=device)
            cached = self.positions[order] = (positions, mask, shares)
        return cached

    def first_nonfinite(self) -> Optional[tuple]:
        """``(parameter name, optimizer step)`` of the first non-finite gradient seen, or None.
        Split gradients: the earliest over the ranks (one all_reduce; every rank asks at the same boundary)."""
        first = self.first
        if self.collective:
            first = torch.tensor(self.NONE, device=self.device) if first is None else first.clone()
            self.parts.reduce(first, dist.ReduceOp.MIN)
        if first is None:
            return None
        key = int(first.item())
        if key == self.NONE:
            return None
        step, index = divmod(key, len(self.named))
        return self.named[index][0], step

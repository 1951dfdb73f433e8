"""The fused kernels written in plain torch ops: the oracle of the kernel tests
and the baseline of ``ddpx bench kernels``.

Each function follows the formula documented in :mod:`ddpx.ops` operation by
operation (same fp32 roundings, same order of the sum over ranks), so the
kernels must match it bit for bit -- except the 1-bit ``mean|v|``, whose
summation order differs (the kernels agree to within a few ulp).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F


def _blocks(v: torch.Tensor, block: int) -> torch.Tensor:
    """The flat ``v`` as [nblocks, block], zero-padded at the end."""
    pad = -v.numel() % block
    return (F.pad(v, (0, pad)) if pad else v).view(-1, block)


def _expand(per_block: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """[R, nblocks] -> [R, n]: each block's value repeated over its elements."""
    return per_block.repeat_interleave(block, dim=-1)[..., :n]


def scale_cast(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return (x.reshape(-1) * scale).to(dtype)


def cast_scale_copy_(dst: torch.Tensor, src: torch.Tensor, scale: float) -> torch.Tensor:
    return dst.view(-1).copy_(src.reshape(-1)).mul_(scale)


def int8_quantize(
    x: torch.Tensor, block: int, error: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    n = x.numel()
    v = x.reshape(-1) if error is None else x.reshape(-1) + error.view(-1)
    vb = _blocks(v, block)
    scale = vb.abs().amax(dim=1) / 127
    finite = torch.isfinite(scale)
    usable = scale > 0  # False for all-zero and NaN blocks
    q = torch.where(usable[:, None], vb / torch.where(usable, scale, 1)[:, None], 0).round_().clamp_(-127, 127)
    scale = torch.where(finite, scale, float("nan"))
    if error is not None:
        residual = (vb - q * scale[:, None]).view(-1)[:n]
        keep = ~_expand(finite, block, n)
        error.view(-1).copy_(torch.where(keep, error.view(-1), residual))
    return q.view(-1)[:n].to(torch.int8), scale


def _rows(t: torch.Tensor) -> torch.Tensor:
    """1-D means one rank's row."""
    return t.unsqueeze(0) if t.dim() == 1 else t


def _sum_rows(rows: torch.Tensor) -> torch.Tensor:
    """rows[0] + rows[1] + ... in that order (the kernels' fp32 summation order)."""
    total = rows[0].clone()
    for r in range(1, rows.shape[0]):
        total += rows[r]
    return total


def _finish(out: torch.Tensor, total: torch.Tensor, alpha: float, accumulate: bool) -> torch.Tensor:
    contribution = total * alpha
    flat = out.view(-1)
    if accumulate:
        flat.add_(contribution)
    else:
        flat.copy_(contribution)
    return out


def int8_dequant_accumulate_(
    out: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int, alpha: float = 1.0, accumulate: bool = False
) -> torch.Tensor:
    n = out.numel()
    q2, s2 = _rows(q), _rows(scales)
    if n == 0 or q2.shape[0] == 0:
        return _finish(out, torch.zeros_like(out.view(-1)), alpha, accumulate)
    if n % block == 0:
        decoded = (q2.view(q2.shape[0], -1, block).float() * s2[:, :, None]).view(q2.shape[0], n)
    else:
        decoded = q2.float() * _expand(s2, block, n)
    return _finish(out, _sum_rows(decoded), alpha, accumulate)


_BIT_WEIGHTS = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)


def onebit_pack(
    x: torch.Tensor, chunk: int, error: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    n = x.numel()
    v = x.reshape(-1) if error is None else x.reshape(-1) + error.view(-1)
    vc = _blocks(v, chunk)
    counts = torch.full((vc.shape[0],), float(chunk), device=v.device)
    if n % chunk:
        counts[-1] = n % chunk
    finite = torch.isfinite(vc).all(dim=1)
    scale = torch.where(finite, vc.abs().sum(dim=1) / counts, float("nan"))
    positive = v >= 0
    padded = F.pad(positive, (0, -n % 8)).view(-1, 8).to(torch.uint8)
    bits = (padded * _BIT_WEIGHTS.to(v.device)).sum(dim=1, dtype=torch.uint8)
    if error is not None:
        s = _expand(scale, chunk, n)
        residual = v - torch.where(positive, s, -s)
        keep = ~_expand(finite, chunk, n)
        error.view(-1).copy_(torch.where(keep, error.view(-1), residual))
    return bits, scale


def onebit_unpack_accumulate_(
    out: torch.Tensor, bits: torch.Tensor, scales: torch.Tensor, chunk: int, alpha: float = 1.0,
    accumulate: bool = False,
) -> torch.Tensor:
    n = out.numel()
    b2, s2 = _rows(bits), _rows(scales)
    if n == 0 or b2.shape[0] == 0:
        return _finish(out, torch.zeros_like(out.view(-1)), alpha, accumulate)
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    positive = ((b2[:, :, None] >> shifts) & 1).view(b2.shape[0], -1)[:, :n].bool()
    s = _expand(s2, chunk, n)
    return _finish(out, _sum_rows(torch.where(positive, s, -s)), alpha, accumulate)


def flatten(tensors: Sequence[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
    if not tensors:
        return torch.empty(0)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return flat if scale == 1.0 else flat * scale


def unflatten_(flat: torch.Tensor, tensors: List[torch.Tensor], scale: float = 1.0) -> None:
    offset = 0
    for t in tensors:
        piece = flat[offset : offset + t.numel()].view_as(t)
        t.copy_(piece) if scale == 1.0 else torch.mul(piece, scale, out=t)
        offset += t.numel()

"""Fused gradient-compression kernels: thin wrappers over the ``torch.ops.ddpx`` ops.

Every op dispatches on the device of its tensors (a CPU kernel and a CUDA
kernel). C++ code (the native comm hooks) calls the same ops through
``csrc/ops/ops.h``. Inputs are fp32 unless stated; an input of any shape is
read as a flat vector (non-contiguous inputs are copied first), while outputs
written in place must be contiguous (``ValueError`` otherwise).

Formats
    int8 blockwise   per block of ``block_size`` consecutive elements (the last
                     block may be shorter): ``scale = max|v| / 127`` (fp32),
                     ``q = clamp(round_half_even(v / scale), -127, 127)``;
                     dequantized value ``q * scale``.
    1-bit            per chunk of ``chunk_size`` elements (a multiple of 8):
                     ``scale = mean|v|``; bit ``i`` is ``v_i >= 0``, packed
                     LSB-first (element ``i`` -> byte ``i // 8``, bit ``i % 8``,
                     padding bits 0); decoded value ``+scale`` or ``-scale``.
    error feedback   with ``error`` given, ``v = x + error`` is compressed and
                     ``error`` becomes ``v - decoded(v)`` in the same pass.

Special values
    An all-zero block gets scale 0 and q 0 (no division by zero). A block or
    chunk holding NaN or +-Inf gets scale NaN, so everything decoded from it is
    NaN -- a non-finite gradient never turns into finite garbage -- and its
    error entries are left unchanged (q of such an int8 block is 0; the 1-bit
    signs are still written). fp16/bf16 casts round to nearest even like
    ``Tensor.to``: NaN stays NaN, values beyond the fp16 range become Inf.

Errors
    wrong dtype -> ``TypeError``; wrong sizes, non-contiguous in-place outputs,
    mixed devices, bad block/chunk sizes -> ``ValueError``; all name the argument.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from . import _C  # noqa: F401  (loading the extension registers torch.ops.ddpx)

__all__ = [
    "scale_cast",
    "cast_scale_copy_",
    "int8_quantize",
    "int8_dequant_accumulate_",
    "onebit_pack",
    "onebit_unpack_accumulate_",
    "onebit_average_repack",
    "flatten",
    "unflatten_",
    "lowrank_project_",
    "lowrank_transpose_project_",
    "lowrank_reconstruct_",
]

_ops = torch.ops.ddpx


def ceil_div(a: int, b: int) -> int:
    """Number of blocks of size ``b`` that hold ``a`` elements (the scale count of a kernel)."""
    return -(-a // b)


def scale_cast(
    x: torch.Tensor, scale: float, dtype: torch.dtype, *, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Return ``(x * scale).to(dtype)`` as a flat tensor, in one pass.

    ``dtype`` is ``torch.float16`` or ``torch.bfloat16``; ``out`` (optional) is a
    preallocated contiguous tensor of that dtype with ``x.numel()`` elements.
    Bit-identical to ``(x.flatten() * scale).to(dtype)``.
    """
    if out is None:
        return _ops.scale_cast(x, float(scale), dtype)
    if out.dtype != dtype:
        raise TypeError(f"ddpx.ops.scale_cast: out must be {dtype}, got {out.dtype}")
    _ops.scale_cast_out(x, float(scale), out)
    return out


def cast_scale_copy_(dst: torch.Tensor, src: torch.Tensor, scale: float) -> torch.Tensor:
    """``dst[:] = src.float() * scale`` in one pass; returns ``dst``.

    ``dst`` is a contiguous fp32 tensor (e.g. the gradient bucket) and ``src`` a
    fp16/bf16 tensor with the same number of elements (any shape).
    """
    _ops.cast_scale_copy_(dst, src, float(scale))
    return dst


def int8_quantize(
    x: torch.Tensor,
    block_size: int,
    error: Optional[torch.Tensor] = None,
    *,
    out_q: Optional[torch.Tensor] = None,
    out_scales: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Blockwise int8 quantization of ``v = x (+ error)``; returns ``(q, scales)``.

    ``q`` is int8 with ``x.numel()`` elements, ``scales`` fp32 with
    ``ceil(x.numel() / block_size)``. With ``error`` (fp32, contiguous, same
    numel) the residual ``v - q * scale`` is written back into it in the same
    pass. ``out_q`` / ``out_scales`` may be preallocated contiguous outputs
    (e.g. slices of a send buffer).
    """
    if out_q is None and out_scales is None:
        return _ops.int8_quantize(x, int(block_size), error)
    if out_q is None:
        out_q = torch.empty(x.numel(), dtype=torch.int8, device=x.device)
    if out_scales is None:
        out_scales = torch.empty(ceil_div(x.numel(), max(int(block_size), 1)), dtype=torch.float32, device=x.device)
    _ops.int8_quantize_out(x, int(block_size), error, out_q, out_scales)
    return out_q, out_scales


def int8_dequant_accumulate_(
    out: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    block_size: int,
    alpha: float = 1.0,
    accumulate: bool = False,
) -> torch.Tensor:
    """``out = (out if accumulate else 0) + alpha * sum_r q[r] * scales[r, block]``.

    ``q`` is int8 ``[R, n]`` and ``scales`` fp32 ``[R, ceil(n / block_size)]``
    (1-D means R = 1), where ``n = out.numel()``; rows may be strided views into
    one receive buffer as long as each row is dense. The rows are summed in
    order r = 0, 1, ... in fp32. Returns ``out``.
    """
    _ops.int8_dequant_accumulate_(out, q, scales, int(block_size), float(alpha), bool(accumulate))
    return out


def onebit_pack(
    x: torch.Tensor,
    chunk_size: int,
    error: Optional[torch.Tensor] = None,
    *,
    out_bits: Optional[torch.Tensor] = None,
    out_scales: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """1-bit sign packing of ``v = x (+ error)``; returns ``(bits, scales)``.

    ``bits`` is uint8 with ``ceil(n / 8)`` bytes, ``scales`` fp32 with
    ``ceil(n / chunk_size)`` entries (mean |v| per chunk); ``chunk_size`` must be
    a multiple of 8. With ``error`` the residual ``v - decoded`` is written back
    in the same pass.
    """
    if out_bits is None and out_scales is None:
        return _ops.onebit_pack(x, int(chunk_size), error)
    if out_bits is None:
        out_bits = torch.empty(ceil_div(x.numel(), 8), dtype=torch.uint8, device=x.device)
    if out_scales is None:
        out_scales = torch.empty(ceil_div(x.numel(), max(int(chunk_size), 1)), dtype=torch.float32, device=x.device)
    _ops.onebit_pack_out(x, int(chunk_size), error, out_bits, out_scales)
    return out_bits, out_scales


def onebit_unpack_accumulate_(
    out: torch.Tensor,
    bits: torch.Tensor,
    scales: torch.Tensor,
    chunk_size: int,
    alpha: float = 1.0,
    accumulate: bool = False,
) -> torch.Tensor:
    """``out = (out if accumulate else 0) + alpha * sum_r decoded(bits[r], scales[r])``.

    ``bits`` uint8 ``[R, ceil(n / 8)]``, ``scales`` fp32 ``[R, ceil(n / chunk_size)]``
    with ``n = out.numel()`` (1-D means R = 1; strided rows allowed). Returns ``out``.
    """
    _ops.onebit_unpack_accumulate_(out, bits, scales, int(chunk_size), float(alpha), bool(accumulate))
    return out


def onebit_average_repack(
    bits: torch.Tensor,
    scales: torch.Tensor,
    chunk_size: int,
    alpha: float,
    error: torch.Tensor,
    out_bits: torch.Tensor,
    out_scales: torch.Tensor,
) -> None:
    """The 1-bit hook's phase 2 in one pass: ``v = alpha * sum_r decoded(bits[r], scales[r])``
    (``n = error.numel()``), then ``onebit_pack(v, chunk_size, error, out_bits=..., out_scales=...)``.

    Bit-identical to :func:`onebit_unpack_accumulate_` into a temporary followed by
    :func:`onebit_pack`; on CPU the average never goes to memory.
    """
    _ops.onebit_average_repack(bits, scales, int(chunk_size), float(alpha), error, out_bits, out_scales)


def flatten(
    tensors: Sequence[torch.Tensor], scale: float = 1.0, *, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Copy same-dtype tensors (any shapes and strides) into one flat buffer, times ``scale``.

    Element order is ``torch.cat([t.reshape(-1) for t in tensors])``. ``scale``
    other than 1 needs a floating dtype. ``out`` (optional, contiguous) may be
    longer than the total; the rest is left untouched. An empty list gives an
    empty fp32 tensor (or ``out`` unchanged).
    """
    tensors = list(tensors)
    if out is None:
        if not tensors:
            return torch.empty(0, dtype=torch.float32)
        total = sum(t.numel() for t in tensors)
        out = torch.empty(total, dtype=tensors[0].dtype, device=tensors[0].device)
    _ops.flatten_out(tensors, float(scale), out)
    return out


def unflatten_(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float = 1.0) -> None:
    """Copy consecutive slices of ``flat`` (times ``scale``) back into ``tensors`` in place.

    The layout is the one :func:`flatten` writes; the destination tensors must be
    contiguous and of ``flat``'s dtype. ``flat`` may be longer than needed.
    """
    _ops.unflatten_(flat, list(tensors), float(scale))


def lowrank_project_(
    m: torch.Tensor, error: torch.Tensor, p_prev: torch.Tensor, qt: torch.Tensor, p: torch.Tensor
) -> torch.Tensor:
    """PowerSGD's first pass: ``error = (m + error) - p_prev @ qt`` and ``p = error @ qt.T``,
    in one pass over ``m`` and ``error``; ``m`` is only read.

    ``error`` holds the previous step's full sum and ``p_prev`` that step's P, so
    the subtraction applies the previous step's approximation lazily; ``error``
    comes out as this step's full sum (gradient plus error feedback). ``m`` and
    ``error`` are fp32 ``[n, k]``, ``qt`` is Q transposed (``[r, k]``), ``p`` and
    ``p_prev`` are ``[n, r]``; all contiguous. On CPU ``p_prev @ qt`` sums over
    c = 0, 1, ... in order and each dot product sums 8 lanes, then the lanes in
    order (the same bits on every CPU); other devices run ``add_``, ``addmm_``
    and ``torch.matmul``. Returns ``p``.
    """
    _ops.lowrank_project_(m, error, p_prev, qt, p)
    return p


def lowrank_transpose_project_(m: torch.Tensor, p: torch.Tensor, qt: torch.Tensor) -> torch.Tensor:
    """PowerSGD's middle pass: ``qt = p.T @ m`` (Q = M^T P, written transposed), one pass over ``m``.

    Shapes as in :func:`lowrank_project_`. On CPU ``qt[c, j]`` sums ``p[i, c] *
    m[i, j]`` over i = 0, 1, ... in order, so any thread count gives the same
    bits; other devices run ``torch.matmul``. Returns ``qt``.
    """
    _ops.lowrank_transpose_project_(m, p, qt)
    return qt


def lowrank_reconstruct_(m: torch.Tensor, p: torch.Tensor, qt: torch.Tensor) -> torch.Tensor:
    """PowerSGD's last pass: ``m = p @ qt``, one write pass.

    Shapes as in :func:`lowrank_project_`. On CPU ``m[i, j]`` sums ``p[i, c] *
    qt[c, j]`` for c = 0, 1, ... in order, so ranks that hold the same ``p`` and
    ``qt`` write the same ``m``. Returns ``m``.
    """
    _ops.lowrank_reconstruct_(m, p, qt)
    return m

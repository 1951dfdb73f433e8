"""``onebit``: 1-bit compression (signs + one scale per chunk) with worker and
server error feedback, DeepSpeed-style, for any optimizer.

1-bit codes are not summable, so the bucket is reduced by hand in two phases
(the int8 hook's pattern):

1. Every rank adds its worker error to its compressed values, packs the signs
   into bits with one fp32 scale (mean |v|) per ``chunk_size`` elements
   (``ddpx.ops.onebit_pack``, error updated in the same pass) and sends segment
   r to rank r with one ``all_to_all_single``.
2. Rank r decodes and averages the R received copies of its segment in fp32,
   adds its server error and packs again (server error updated), all in one
   pass (``ddpx.ops.onebit_average_repack``: the average never goes to memory),
   and an ``all_gather_single`` gives every rank every averaged segment, decoded
   into the bucket.

Buckets are pipelined as int8's are (ddpx/hooks/twophase.py).

Exempt parameters (small and 1-D by default) ride along as fp32 in the same two
messages: each rank's message is one byte buffer ``[plain fp32 | scales fp32 |
bits]``. A chunk holding NaN/Inf gets a NaN scale, so a non-finite gradient
stays non-finite. Wire per rank (ring model): about 2 (R-1)/R x (1/8 + 4 /
chunk_size) bytes per compressed element: 26x less than fp32 at the default
``chunk_size`` of 128 (21x at 64).

Chunk size. The scale of a chunk is mean |v|, so elements much larger than the
chunk's mean are under-represented until their error memory has grown: the
larger the chunk, the larger the error memory gets (with a constant gradient,
about 6x the gradient's norm at 32 elements, 20x at 256, 50x at 2048) and the
later large gradients arrive. Chunks of 32-128 train like fp32 allreduce on
the digits MLP (SGD momentum 0.9, 30 epochs); 256 and above lost 1-25 points.

Warm-up. ``warmup_steps`` runs plain fp32 allreduce for the first N steps.
Error feedback repays the compression error over later steps, so 1-bit hurts
most early in training from scratch and with momentum optimizers, whose state
integrates the error first (DeepSpeed's 1-bit Adam always warms up: its
``freeze_step``). Use a few hundred steps there if the early loss lags fp32;
on the digits MLP (SGD momentum 0.9, or Adam) the default chunk size needed
none, hence the default of 0.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import ops
from .base import LossyState, Option, positive_multiple_of
from .twophase import TwoPhaseState, all_gather_single, segment_spans



class OnebitState(TwoPhaseState):
    """1-bit signs with a per-chunk scale, worker and server error feedback."""

    name = "onebit"
    native_kind = "onebit"
    options = {
        **LossyState.options,
        "chunk_size": Option(int, 128, positive_multiple_of(8), "elements per fp32 scale"),
    }
    memories = ("worker_error", "server_error")

    def build_layout(self, lay):
        world, rank, chunk = self.world_size, self.rank, self.chunk_size
        dev = lay.params[0].device
        f32 = dict(dtype=torch.float32, device=dev)
        # compressed parameters are packed in descending key order, not bucket order: the
        # chunks, and so the results, then do not depend on the order DDP lists a bucket's
        # parameters in (it changes at the bucket rebuild: a resumed run's first step
        # matches), and after the rebuild (gradient-ready order, i.e. descending keys for
        # most models) the packing order usually is the bucket order
        offsets, off = [], 0
        for p in lay.params:
            offsets.append(off)
            off += p.numel()
        order = [i for i, poff in enumerate(lay.param_packed_offset) if poff is not None]
        order.sort(key=lambda i: -lay.keys[i])
        # [(bucket offset, numel)] per compressed parameter, in packing order (int64 [k, 2])
        slices = [(offsets[i], lay.params[i].numel()) for i in order]
        lay.comp_order = torch.tensor(slices, dtype=torch.int64).reshape(-1, 2)
        # packed order == one contiguous stretch of the bucket: work in the bucket itself
        # (no flatten/unflatten copies); its offset, or -1
        contiguous = all(a[0] + a[1] == b[0] for a, b in zip(slices, slices[1:]))
        lay.direct_offset = slices[0][0] if slices and contiguous else -1
        # each rank's segment: whole chunks and whole 32-bit words, so every row of
        # the byte messages below keeps its fp32 fields 4-byte aligned
        align = chunk * 32 // math.gcd(chunk, 32)
        lay.seg = ops.ceil_div(ops.ceil_div(lay.n_comp, world), align) * align
        lay.lengths = [max(0, min(lay.seg, lay.n_comp - r * lay.seg)) for r in range(world)]
        lay.chunks = lay.seg // chunk
        lay.plain_chunk = ops.ceil_div(lay.n_plain, world)
        lay.piece = 4 * lay.plain_chunk + 4 * lay.chunks + lay.seg // 8  # bytes per rank message
        # Otherwise, when every compressed parameter is a whole number of chunks, each
        # (segment, parameter) overlap is whole chunks too: pack straight from and finish
        # straight into the bucket, span by span (rank, bucket offset, numel, segment
        # offset), again without packing copies. Same chunks, same bits as packing first.
        spans = segment_spans(slices, lay.seg, chunk) if lay.direct_offset < 0 else []
        lay.spans = torch.tensor(spans, dtype=torch.int64).reshape(-1, 4)
        # packed compressed values (only the first n_comp elements are used)
        lay.comp = torch.zeros(lay.n_comp if lay.direct_offset < 0 and not spans else 0, **f32)
        lay.plain = torch.zeros(world * lay.plain_chunk, **f32)
        lay.worker_error = torch.zeros(world * lay.seg, **f32)
        lay.server_error = torch.zeros(world * lay.seg, **f32)  # only this rank's segment is used
        lay.send = torch.zeros(world * lay.piece, dtype=torch.uint8, device=dev)
        lay.recv = torch.zeros_like(lay.send)
        lay.send2 = torch.zeros(lay.piece, dtype=torch.uint8, device=dev)
        lay.recv2 = torch.zeros_like(lay.send)
        packed = 0
        for i in order:
            n = lay.params[i].numel()
            self.adopt("worker_error", lay.keys[i], lay.worker_error.narrow(0, packed, n))
            self.adopt("server_error", lay.keys[i], lay.server_error.narrow(0, packed, n))
            packed += n
        # server memory carried over from another layout is only valid for our segment
        own = slice(rank * lay.seg, (rank + 1) * lay.seg)
        keep = lay.server_error[own].clone()
        lay.server_error.zero_()
        lay.server_error[own] = keep

    def _views(self, lay, rows, m):
        """(plain fp32 [R, e], scales fp32 [R, ceil(m/chunk)], bits uint8 [R, ceil(m/8)]) views of a
        [R * piece] byte buffer whose rows hold segments of m compressed elements."""
        rows = rows.view(-1, lay.piece)
        e4, b4 = 4 * lay.plain_chunk, 4 * lay.chunks
        plain = rows[:, :e4].view(torch.float32)
        scales = rows[:, e4:e4 + 4 * ops.ceil_div(m, self.chunk_size)].view(torch.float32)
        bits = rows[:, e4 + b4:e4 + b4 + ops.ceil_div(m, 8)]
        return plain, scales, bits

    def _compressed(self, buf, lay):
        """(the compressed values as one flat tensor or None when they go span by span,
        the bucket slices to pack from and unpack into, or None): the bucket itself where
        they are one contiguous stretch of it; else, where every compressed parameter is
        whole chunks, none (``lay.spans``); else the packed ``lay.comp`` buffer."""
        if lay.direct_offset >= 0:
            return buf.narrow(0, lay.direct_offset, lay.n_comp), None
        if lay.spans.numel():
            return None, None
        return lay.comp, [buf.narrow(0, off, n) for off, n in lay.comp_order.tolist()]

    def start_phase1(self, buf, lay):
        """Phase 1: pack each destination's segment into its piece; start the exchange."""
        world, chunk, s = self.world_size, self.chunk_size, lay.seg
        comp_buf, comp = self._compressed(buf, lay)
        if comp is not None:
            ops.flatten(comp, out=comp_buf)
        ops.flatten(lay.runs(buf, False), out=lay.plain)
        self._views(lay, lay.send, 0)[0].copy_(lay.plain.view(world, -1))
        if comp_buf is None:
            for r, boff, n, soff in lay.spans.tolist():
                _, scales, bits = self._views(lay, lay.send, lay.lengths[r])
                ops.onebit_pack(buf.narrow(0, boff, n), chunk, lay.worker_error.narrow(0, r * s + soff, n),
                                out_bits=bits[r, soff // 8:(soff + n) // 8],
                                out_scales=scales[r, soff // chunk:(soff + n) // chunk])
        else:
            for r, m in enumerate(lay.lengths):
                _, scales, bits = self._views(lay, lay.send, m)
                ops.onebit_pack(comp_buf.narrow(0, r * s, m), chunk, lay.worker_error.narrow(0, r * s, m),
                                out_bits=bits[r], out_scales=scales[r])
        return dist.all_to_all_single(lay.recv, lay.send, group=self.worker_group, async_op=True)

    def start_phase2(self, buf, lay, exchange):
        """Average this rank's segment in fp32, server error feedback, re-pack, start the all-gather."""
        world, rank, chunk = self.world_size, self.rank, self.chunk_size
        exchange.wait()
        m = lay.lengths[rank]
        plain, scales, bits = self._views(lay, lay.recv, m)
        plain2, scales2, bits2 = self._views(lay, lay.send2, m)
        torch.sum(plain, dim=0, out=plain2[0]).mul_(1.0 / world)
        ops.onebit_average_repack(bits, scales, chunk, 1.0 / world, lay.server_error.narrow(0, rank * lay.seg, m),
                                  out_bits=bits2[0], out_scales=scales2[0])
        return all_gather_single(lay.recv2, lay.send2, group=self.worker_group, async_op=True)

    def finish(self, buf, lay, gather):
        """Unpack every averaged segment into the bucket."""
        world, chunk, s = self.world_size, self.chunk_size, lay.seg
        comp_buf, comp = self._compressed(buf, lay)
        gather.wait()
        if comp_buf is None:
            for r, boff, n, soff in lay.spans.tolist():
                _, scales, bits = self._views(lay, lay.recv2, lay.lengths[r])
                ops.onebit_unpack_accumulate_(buf.narrow(0, boff, n), bits[r, soff // 8:(soff + n) // 8],
                                              scales[r, soff // chunk:(soff + n) // chunk], chunk)
        else:
            for r, m in enumerate(lay.lengths):
                _, scales, bits = self._views(lay, lay.recv2, m)
                ops.onebit_unpack_accumulate_(comp_buf.narrow(0, r * s, m), bits[r], scales[r], chunk)
        lay.plain.view(world, -1).copy_(self._views(lay, lay.recv2, 0)[0])
        if comp is not None:
            ops.unflatten_(comp_buf, comp)
        ops.unflatten_(lay.plain, lay.runs(buf, False))


HOOKS = {"onebit": OnebitState}

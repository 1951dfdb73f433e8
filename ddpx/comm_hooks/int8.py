"""``int8``: blockwise int8 with error feedback (worker and server side).

int8 codes are not summable, so the bucket is reduced by hand in two phases:

1. Every rank adds its worker error to its compressed values, quantizes them
   per block of ``block_size`` (one fp32 scale per block, ``ddpx.ops.int8_quantize``)
   and sends chunk r to rank r with one ``all_to_all_single``.
2. Rank r sums the R received copies of its chunk in fp32 and averages
   (``int8_dequant_accumulate_``), adds its server error, requantizes, and an
   ``all_gather_single`` gives every rank every averaged chunk, which is
   dequantized into the bucket.

Buckets are pipelined on the executor (ddpx/comm_hooks/twophase.py): bucket i's
quantize and all-to-all start before bucket i-1's reduce and all-gather, and
bucket i-2 is decoded only then, so the link has the next collective queued
while the CPU codes a neighbour. The order is fixed (A2A 0, A2A 1, AG 0,
A2A 2, AG 1, ..., AG last), the same on every rank.

Under ``trainer.strategy: fsdp`` the same codes are FSDP2's gradient reduce-scatter
(``Int8ReduceScatter``, ddpx/comm_hooks/reduce_scatter.py).

Exempt parameters (small and 1-D by default) ride along as fp32 in the same
two messages: each rank's message is one byte buffer ``[plain fp32 | scales
fp32 | q int8]``. A block holding NaN/Inf gets a NaN scale, so a non-finite
gradient stays non-finite. Wire per rank (ring model): about
2 (R-1)/R x (1 + 4/block_size) bytes per compressed element.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import ops
from .options import LOSSY, Option, non_negative, positive_multiple_of
from .reduce_scatter import CompressedReduceScatter
from .registry import Method
from .twophase import (Piece, TwoPhaseState, all_gather_single, piece_elements, piece_ranges, piece_spans,
                       segment_spans)

# auto: (without, with an Adam-family optimizer), resolved by pairing (ddpx/comm_hooks/comm_state.py)
BLOCK_SIZE = Option(object, "auto", lambda v: None if v == "auto" or (
    type(v) is int and positive_multiple_of(4)(v) is None) else "must be 'auto' or a positive multiple of 4",
    "elements per fp32 scale; auto: 64 with an Adam-family optimizer, else 256", auto=(256, 64))


class Int8State(TwoPhaseState):
    """Blockwise int8 with worker and server error feedback.

    ``piece_mb`` (default 2): a bucket is coded, sent and decoded in pieces of
    about this many MB of fp32 gradient, pipelined (ddpx/comm_hooks/twophase.py),
    so DDP's default 25 MB buckets do not leave the link idle while a whole
    bucket is quantized. A piece is the same range of whole blocks of every
    rank's chunk of the unsplit bucket: blocks, codes, error memory and results
    are bit-identical to ``piece_mb=0`` (no split). 2 MB: on 2 hosts at 1
    Gbit/s with ``DDP(model)`` (benchmarks/bench_comm.py, 12 x Linear(1024,
    1024)) no split took 162 ms/step, 1-8 MB pieces 130-150 (within the noise
    of a shared 2-core machine of each other), against 122-155 for the tuned
    4 MB buckets; int8 is near its link bound there (12.8 MB a step on the
    wire at the block size of then, 256: 102 ms at 1 Gbit/s).

    ``block_size`` (default ``auto``): elements per fp32 scale. ``auto`` is 64 once the
    state is paired with an Adam-family optimizer (``betas``; ``state.pair(optimizer)``
    before the first step, which ``ddpx train`` does), else 256. With AdamW,
    256 missed the 0.01-nat target of the GPT table (+0.016) and 64 meets it; Adam
    divides by the root of its second moment, so the small elements that share a
    block with an outlier, rounded to zero or one step, move the update most. 64
    costs 4.7 % more wire and slower quantizing, which SGD does not need
    (docs/comm_hooks.md: the GPT table, and the 2-host benchmark's cost). The stage 2
    of ``scope=inter_node`` codes with this state's block size (it shares the ``auto`` values).
    """

    memories = ("worker_error", "server_error")

    @property
    def block_size(self) -> int:
        """Elements per scale: the option, or for ``auto`` 64 when paired with an Adam-family
        optimizer, else 256."""
        return self.option("block_size")

    @property
    def coding_unit(self) -> int:
        return self.block_size

    def state_dict(self) -> dict:
        chosen = self.opts["block_size"] != "auto" or self.auto_options.chosen("block_size")
        return dict(super().state_dict(), block_size=self.block_size if chosen else None)

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        if sd.get("block_size") in BLOCK_SIZE.auto:
            self.auto_options.restore("block_size", sd["block_size"])  # a resumed run codes as the saved one did

    def build_layout(self, lay):
        world, rank, block = self.world_size, self.rank, self.block_size
        dev = lay.params[0].device
        f32 = dict(dtype=torch.float32, device=dev)
        # per-rank chunk sizes: compressed elements padded to whole blocks
        lay.chunk = ops.ceil_div(ops.ceil_div(lay.n_comp, world), block) * block
        lay.plain_chunk = ops.ceil_div(lay.n_plain, world)
        # where every compressed run is whole blocks: code straight from the bucket, span by span
        spans = segment_spans([(boff, n) for boff, n, _ in lay.comp_runs], lay.chunk, block)
        # packed compressed values (+ zero padding), when there are no spans
        lay.comp = torch.zeros(0 if spans else world * lay.chunk, **f32)
        lay.plain = torch.zeros(world * lay.plain_chunk, **f32)
        lay.reduced = torch.zeros(lay.chunk, **f32)
        lay.worker_error = torch.zeros(world * lay.chunk, **f32)
        lay.server_error = torch.zeros(world * lay.chunk, **f32)  # only this rank's chunk is used
        for key, p, poff in zip(lay.keys, lay.params, lay.param_packed_offset):
            if poff is not None:
                self.adopt("worker_error", key, lay.worker_error.narrow(0, poff, p.numel()))
                self.adopt("server_error", key, lay.server_error.narrow(0, poff, p.numel()))
        # server memory carried over from another layout is only valid for our chunk
        own = slice(rank * lay.chunk, (rank + 1) * lay.chunk)
        keep = lay.server_error[own].clone()
        lay.server_error.zero_()
        lay.server_error[own] = keep
        # pieces: the same block range [base, base + chunk) of every rank's chunk; the
        # first piece also carries the exempt values. Each has its own messages, so
        # pieces in flight do not share buffers.
        ranges = piece_ranges(lay.chunk, piece_elements(self.opts["piece_mb"], world, block))
        lay.pieces = []
        for j, (base, n) in enumerate(ranges):
            plain_chunk = lay.plain_chunk if j == 0 else 0
            piece = 4 * plain_chunk + 4 * (n // block) + n  # bytes per rank message
            pc = Piece(j, len(ranges), base=base, chunk=n, blocks=n // block, block=block, plain_chunk=plain_chunk,
                       piece=piece, stride=lay.chunk,
                       spans=torch.tensor(piece_spans(spans, base, n), dtype=torch.int64).reshape(-1, 4),
                       reduced=lay.reduced.narrow(0, base, n),
                       send=torch.zeros(world * piece, dtype=torch.uint8, device=dev),
                       recv=torch.zeros(world * piece, dtype=torch.uint8, device=dev),
                       send2=torch.zeros(piece, dtype=torch.uint8, device=dev),
                       recv2=torch.zeros(world * piece, dtype=torch.uint8, device=dev))
            lay.pieces.append(pc)
        lay.spans = torch.tensor(spans, dtype=torch.int64).reshape(-1, 4)

    def _views(self, pc, rows):
        """(plain fp32 [R, e], scales fp32 [R, b], q int8 [R, c]) views of a [R * piece] byte buffer."""
        m = rows.view(-1, pc.piece)
        e4, b4 = 4 * pc.plain_chunk, 4 * pc.blocks
        plain = m[:, :e4].view(torch.float32)
        scales = m[:, e4:e4 + b4].view(torch.float32)
        q = m[:, e4 + b4:].view(torch.int8)
        return plain, scales, q

    def start_phase1(self, buf, lay, pc):
        """Phase 1: quantize each destination's chunk of the piece; start the exchange."""
        world, block = self.world_size, pc.block
        s, c = pc.stride, pc.chunk
        plain, scales, q = self._views(pc, pc.send)
        if pc.first:
            ops.flatten(lay.runs(buf, False), out=lay.plain)
            plain.copy_(lay.plain.view(world, lay.plain_chunk))
            if not lay.spans.numel():
                ops.flatten(lay.runs(buf, True), out=lay.comp)
        if lay.spans.numel():
            for r, boff, n, soff in pc.spans.tolist():
                ops.int8_quantize(buf.narrow(0, boff, n), block, lay.worker_error.narrow(0, r * s + pc.base + soff, n),
                                  out_q=q[r, soff:soff + n], out_scales=scales[r, soff // block:(soff + n) // block])
        else:
            for r in range(world):
                ops.int8_quantize(lay.comp.narrow(0, r * s + pc.base, c), block,
                                  lay.worker_error.narrow(0, r * s + pc.base, c), out_q=q[r], out_scales=scales[r])
        return dist.all_to_all_single(pc.recv, pc.send, group=self.executor_group, async_op=True)

    def start_phase2(self, buf, lay, pc, exchange):
        """Average this rank's chunk of the piece in fp32, server error feedback, requantize, start the all-gather."""
        world, rank, block = self.world_size, self.rank, pc.block
        exchange.wait()
        plain, scales, q = self._views(pc, pc.recv)
        plain2, scales2, q2 = self._views(pc, pc.send2)
        torch.sum(plain, dim=0, out=plain2[0]).mul_(1.0 / world)
        ops.int8_dequant_accumulate_(pc.reduced, q, scales, block, 1.0 / world)
        ops.int8_quantize(pc.reduced, block, lay.server_error.narrow(0, rank * pc.stride + pc.base, pc.chunk),
                          out_q=q2[0], out_scales=scales2[0])
        return all_gather_single(pc.recv2, pc.send2, group=self.executor_group, async_op=True)

    def finish(self, buf, lay, pc, gather):
        """Dequantize every averaged chunk of the piece into the bucket."""
        world, block = self.world_size, pc.block
        s, c = pc.stride, pc.chunk
        gather.wait()
        plain, scales, q = self._views(pc, pc.recv2)
        if lay.spans.numel():
            for r, boff, n, soff in pc.spans.tolist():
                ops.int8_dequant_accumulate_(buf.narrow(0, boff, n), q[r, soff:soff + n],
                                             scales[r, soff // block:(soff + n) // block], block)
        else:
            for r in range(world):
                ops.int8_dequant_accumulate_(lay.comp.narrow(0, r * s + pc.base, c), q[r], scales[r], block)
            if pc.last:
                ops.unflatten_(lay.comp, lay.runs(buf, True))
        if pc.first:
            lay.plain.view(world, lay.plain_chunk).copy_(plain)
            ops.unflatten_(lay.plain, lay.runs(buf, False))


class Int8ReduceScatter(CompressedReduceScatter):
    """int8 as FSDP2's gradient reduce-scatter: each destination's chunk quantized in blocks
    (no error feedback: ddpx/comm_hooks/reduce_scatter.py says why), one all-to-all, the
    received copies summed in fp32."""

    @property
    def block_size(self) -> int:
        return self.option("block_size")

    def row_bytes(self, n):
        return 4 * ops.ceil_div(n, self.block_size) + 4 * ops.ceil_div(n, 4)

    def _views(self, buf, world, n):
        """(scales fp32 [R, b], q int8 [R, n]) views of a [R * row] byte buffer."""
        rows = buf.view(world, -1)
        b4 = 4 * ops.ceil_div(n, self.block_size)
        return rows[:, :b4].view(torch.float32), rows[:, b4:b4 + n].view(torch.int8)

    def reduce_scatter(self, output, flat, group, world, n, alpha):
        send = torch.empty(world * self.row_bytes(n), dtype=torch.uint8, device=flat.device)
        recv = torch.empty_like(send)
        scales, q = self._views(send, world, n)
        for r in range(world):
            ops.int8_quantize(flat.narrow(0, r * n, n), self.block_size, out_q=q[r], out_scales=scales[r])
        dist.all_to_all_single(recv, send, group=group)
        scales, q = self._views(recv, world, n)
        ops.int8_dequant_accumulate_(output, q, scales, self.block_size, alpha)


METHODS = (Method(
    "int8", Int8State,
    options={**LOSSY, "block_size": BLOCK_SIZE,
             "piece_mb": Option(float, 2.0, non_negative,
                                "MB of fp32 gradient per pipelined piece of a bucket (0: one piece per bucket)")},
    native="int8",
    sharded=Int8ReduceScatter, sharded_options=("block_size", "scope"),
    # A bucket is coded only once DDP has all of it: with 25 MB buckets the first (after the
    # 1 MB one) waits for 6 of the benchmark model's 12 layers. 4 MB buckets start the wire a
    # layer after backward does (benchmarks/bench_comm.py, 1 Gbit/s, before pieces: 166 -> 119
    # ms/step); with pieces the gap is small.
    bucket_cap_mb=4.0),)

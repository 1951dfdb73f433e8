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

Buckets are pipelined as int8's are (ddpx/comm_hooks/twophase.py).

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

Defaults for accuracy: ``warmup_steps`` 100 and ``min_numel`` 16384 (other
lossy hooks: 0 and 1024), chosen on the convergence matrix of
benchmarks/bench_convergence.py (digits, 2 ranks, DDP(model) + register, an MLP
and a CNN with BatchNorm, SGD momentum 0.9 and Adam, batch 16 and 128 per rank,
3 and 12 epochs; docs/comm_hooks.md). With the old defaults (no warm-up,
min_numel 1024) 1-bit lost up to 14.5 points (MLP, SGD, batch 16, 3 epochs),
10.9 (CNN, SGD, same), 5-7 in three more cells. A warm-up alone did not fix it:
on the MLP with SGD momentum 0.9 (lr 0.05, batch 16) 1-bit destabilised the run
for a few hundred steps whenever compression started (test accuracy dipping to
53-80 %), so every count left a run length that ended in the dip (12 epochs:
-17.3 points at 300 warm-up steps, -5.6 at 150, -3.6 at 200; 3 epochs: -16.2 at
100). Smaller chunks (32, 64) did not shorten the dip. What did was leaving
the small matrices out: the MLP's 64x128 input and 128x10 output layers (8192
and 1280 elements) are where one sign per element hurt; with them exempt (any
``min_numel`` above 8192) the dip was gone and every cell stayed within 1.5
points at 0.5-0.6 worst with 100 or 200 warm-up steps (5.0 with none: 18
steps of Adam at batch 128). A matrix under 16384 elements is at most 64 KB
of fp32 a step, nothing on the wire of a model whose communication matters
(the benchmark model's matrices have 1M elements). The 100 warm-up steps
cover the runs too short for error feedback to repay the error (18-72 step
cells); a fraction of the first epoch cannot be known to a hook, and a count
driven by the error memory's norm would need every rank to agree on that norm
each step (an extra collective). Pass ``warmup_steps=0, min_numel=1024`` for
the old behaviour.

Pieces: a bucket is coded, sent and decoded in pieces of about ``piece_mb``
(default 16) MB of fp32 gradient, pipelined (ddpx/comm_hooks/twophase.py); a piece
is the same range of whole chunks of every rank's segment of the unsplit
bucket, so the results are bit-identical to ``piece_mb=0``. 16 MB (a 25 MB
bucket goes in 2 pieces): at 1/26 of fp32 a piece is short on the wire, so
each piece's two collectives cost more in latency than the overlap wins back.
On 2 hosts at 1 Gbit/s with ``DDP(model)`` (benchmarks/bench_comm.py, the 12 x
Linear(1024, 1024) model) 4 MB pieces took 80 ms/step, 8 MB 61, 12-16 MB
56-63, no split 56-58 (runs on a shared 2-core machine: +-10 %).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import ops
from .comm_state import adam_family, log
from .options import LOSSY, Option, non_negative, positive_multiple_of
from .registry import Method, method_for_optimizer
from .twophase import (Piece, TwoPhaseState, all_gather_single, piece_elements, piece_ranges, piece_spans,
                       segment_spans)


_adam_warned = False  # the warning of warn_with_adam is given once per process


def warn_with_adam(optimizer) -> None:
    """1-bit gradients with error feedback do not give Adam the update it would have had (a
    small GPT with AdamW lost 0.41 nats); the momentum path ``onebit_adam`` does: say so,
    once, when the hook is paired with an Adam-family optimizer (not one that needs a hook
    of its own, which would refuse it)."""
    global _adam_warned
    if _adam_warned or not adam_family(optimizer) or method_for_optimizer(type(optimizer)) is not None:
        return
    _adam_warned = True
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.warning("comm hook 'onebit' with %s: 1-bit gradients do not give Adam the update it would have had "
                    "(a small GPT with AdamW lost 0.4 nats); use the Adam-aware path, optimizer "
                    "ddpx.optim.OneBitAdam with comm hook 'onebit_adam' (docs/comm_hooks.md)", type(optimizer).__name__)


class OnebitState(TwoPhaseState):
    """1-bit signs with a per-chunk scale, worker and server error feedback."""

    memories = ("worker_error", "server_error")

    @property
    def chunk_size(self) -> int:
        """Elements per fp32 scale (the option)."""
        return self.opts["chunk_size"]

    @property
    def coding_unit(self) -> int:
        return self.chunk_size

    def pair(self, optimizer) -> None:
        super().pair(optimizer)
        if self.method.optimizer is None:  # the gradient hook, not onebit_adam's momentum
            warn_with_adam(optimizer)

    def build_layout(self, lay):
        world, chunk = self.world_size, self.chunk_size
        f32 = dict(dtype=torch.float32, device=lay.params[0].device)
        order, slices = self._packing(lay)
        # each rank's segment: whole chunks and whole 32-bit words, so every row of
        # the byte messages below keeps its fp32 fields 4-byte aligned
        align = chunk * 32 // math.gcd(chunk, 32)
        lay.seg = ops.ceil_div(ops.ceil_div(lay.n_comp, world), align) * align
        lay.lengths = [max(0, min(lay.seg, lay.n_comp - r * lay.seg)) for r in range(world)]
        lay.plain_chunk = ops.ceil_div(lay.n_plain, world)
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
        lay.pieces = self._pieces(lay, spans, align)
        self._adopt_memory(lay, order)

    @staticmethod
    def _packing(lay):
        """(the compressed parameters' indices in packing order, their [(bucket offset, numel)]);
        sets ``lay.comp_order`` (those slices, int64 [k, 2]) and ``lay.direct_offset``."""
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
        slices = [(offsets[i], lay.params[i].numel()) for i in order]
        lay.comp_order = torch.tensor(slices, dtype=torch.int64).reshape(-1, 2)
        # packed order == one contiguous stretch of the bucket: work in the bucket itself
        # (no flatten/unflatten copies); its offset, or -1
        contiguous = all(a[0] + a[1] == b[0] for a, b in zip(slices, slices[1:]))
        lay.direct_offset = slices[0][0] if slices and contiguous else -1
        return order, slices

    def _pieces(self, lay, spans, align) -> list:
        """The same chunk range [base, base + seg) of every rank's segment; the first piece
        also carries the exempt values; each has its own messages."""
        world, chunk, dev = self.world_size, self.chunk_size, lay.params[0].device
        ranges = piece_ranges(lay.seg, piece_elements(self.opts["piece_mb"], world, align))
        pieces = []
        for j, (base, n) in enumerate(ranges):
            plain_chunk = lay.plain_chunk if j == 0 else 0
            piece = 4 * plain_chunk + 4 * (n // chunk) + n // 8  # bytes per rank message
            pieces.append(Piece(
                j, len(ranges), base=base, seg=n, chunks=n // chunk, plain_chunk=plain_chunk, piece=piece,
                stride=lay.seg, lengths=[max(0, min(n, m - base)) for m in lay.lengths],
                spans=torch.tensor(piece_spans(spans, base, n), dtype=torch.int64).reshape(-1, 4),
                send=torch.zeros(world * piece, dtype=torch.uint8, device=dev),
                recv=torch.zeros(world * piece, dtype=torch.uint8, device=dev),
                send2=torch.zeros(piece, dtype=torch.uint8, device=dev),
                recv2=torch.zeros(world * piece, dtype=torch.uint8, device=dev)))
        return pieces

    def _adopt_memory(self, lay, order) -> None:
        """Each compressed parameter's error memory, carried over into this layout."""
        packed = 0
        for i in order:
            n = lay.params[i].numel()
            self.adopt("worker_error", lay.keys[i], lay.worker_error.narrow(0, packed, n))
            self.adopt("server_error", lay.keys[i], lay.server_error.narrow(0, packed, n))
            packed += n
        # server memory carried over from another layout is only valid for our segment
        own = slice(self.rank * lay.seg, (self.rank + 1) * lay.seg)
        keep = lay.server_error[own].clone()
        lay.server_error.zero_()
        lay.server_error[own] = keep

    def _views(self, pc, rows, m):
        """(plain fp32 [R, e], scales fp32 [R, ceil(m/chunk)], bits uint8 [R, ceil(m/8)]) views of a
        [R * piece] byte buffer whose rows hold segments of m compressed elements."""
        rows = rows.view(-1, pc.piece)
        e4, b4 = 4 * pc.plain_chunk, 4 * pc.chunks
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

    def start_phase1(self, buf, lay, pc):
        """Phase 1: pack each destination's segment of the piece; start the exchange."""
        world, chunk, s = self.world_size, self.chunk_size, pc.stride
        comp_buf, comp = self._compressed(buf, lay)
        if pc.first:
            if comp is not None:
                ops.flatten(comp, out=comp_buf)
            ops.flatten(lay.runs(buf, False), out=lay.plain)
            self._views(pc, pc.send, 0)[0].copy_(lay.plain.view(world, -1))
        if comp_buf is None:
            for r, boff, n, soff in pc.spans.tolist():
                _, scales, bits = self._views(pc, pc.send, pc.lengths[r])
                ops.onebit_pack(buf.narrow(0, boff, n), chunk, lay.worker_error.narrow(0, r * s + pc.base + soff, n),
                                out_bits=bits[r, soff // 8:(soff + n) // 8],
                                out_scales=scales[r, soff // chunk:(soff + n) // chunk])
        else:
            for r, m in enumerate(pc.lengths):
                _, scales, bits = self._views(pc, pc.send, m)
                ops.onebit_pack(comp_buf.narrow(0, r * s + pc.base, m), chunk,
                                lay.worker_error.narrow(0, r * s + pc.base, m), out_bits=bits[r], out_scales=scales[r])
        return dist.all_to_all_single(pc.recv, pc.send, group=self.executor_group, async_op=True)

    def start_phase2(self, buf, lay, pc, exchange):
        """Average this rank's segment of the piece in fp32, server error feedback, re-pack, start the all-gather."""
        world, rank, chunk = self.world_size, self.rank, self.chunk_size
        exchange.wait()
        m = pc.lengths[rank]
        plain, scales, bits = self._views(pc, pc.recv, m)
        plain2, scales2, bits2 = self._views(pc, pc.send2, m)
        torch.sum(plain, dim=0, out=plain2[0]).mul_(1.0 / world)
        ops.onebit_average_repack(bits, scales, chunk, 1.0 / world,
                                  lay.server_error.narrow(0, rank * pc.stride + pc.base, m),
                                  out_bits=bits2[0], out_scales=scales2[0])
        return all_gather_single(pc.recv2, pc.send2, group=self.executor_group, async_op=True)

    def finish(self, buf, lay, pc, gather):
        """Unpack every averaged segment of the piece into the bucket."""
        world, chunk, s = self.world_size, self.chunk_size, pc.stride
        comp_buf, comp = self._compressed(buf, lay)
        gather.wait()
        if comp_buf is None:
            for r, boff, n, soff in pc.spans.tolist():
                _, scales, bits = self._views(pc, pc.recv2, pc.lengths[r])
                ops.onebit_unpack_accumulate_(buf.narrow(0, boff, n), bits[r, soff // 8:(soff + n) // 8],
                                              scales[r, soff // chunk:(soff + n) // chunk], chunk)
        else:
            for r, m in enumerate(pc.lengths):
                _, scales, bits = self._views(pc, pc.recv2, m)
                ops.onebit_unpack_accumulate_(comp_buf.narrow(0, r * s + pc.base, m), bits[r], scales[r], chunk)
        if pc.first:
            lay.plain.view(world, -1).copy_(self._views(pc, pc.recv2, 0)[0])
            ops.unflatten_(lay.plain, lay.runs(buf, False))
        if pc.last and comp is not None:
            ops.unflatten_(comp_buf, comp)


METHODS = (Method(
    "onebit", OnebitState,
    options={**LOSSY,
             "warmup_steps": Option(int, 100, non_negative,
                                    "iterations of plain fp32 allreduce before compression starts (see the docstring)"),
             "min_numel": Option(int, 16384, non_negative,
                                 "parameters with fewer elements are sent uncompressed (see the docstring)"),
             "chunk_size": Option(int, 128, positive_multiple_of(8), "elements per fp32 scale"),
             "piece_mb": Option(float, 16.0, non_negative,
                                "MB of fp32 gradient per pipelined piece of a bucket (0: one piece per bucket)")},
    native="onebit"),)

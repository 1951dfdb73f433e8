"""``powersgd``: rank-r PowerSGD (Vogels et al., 2019) with error feedback and
warm start, on gloo and NCCL, with several buckets in flight.

Per bucket, every matrix-shaped gradient G (n x m, higher dims flattened to
n x prod(rest)) plus its error feedback, M, is approximated as P Q^T:

1. M = G + (the previous step's M - P' Q'^T), P = M Q for every matrix; all
   P's of the bucket and the uncompressed parameters (vectors, small tensors;
   fp32, pre-divided by world) go in one buffer and one allreduce.
2. Orthogonalize the P's (``torch.linalg.qr``, one batched call per matrix
   shape of the piece), Q = M^T P; all Q's in one allreduce, divided by world.
3. P Q^T is written into the bucket. The averaged Q is the next step's
   starting Q (warm start).

The error M - P Q^T is never written: the "error" memory keeps M itself and
the "p" memory keeps P, and step 1 of the next step subtracts P' Q'^T (Q' is
the warm-start Q) in the same pass that adds the gradient. That makes five
memory passes over each matrix per step instead of seven.

Q starts from a seeded normal draw per parameter (``seed`` + the parameter's
ordinal), identical on every rank. Error and Q memory are per parameter, so
they survive DDP's bucket rebuild and ``state_dict()``; a world-size change on
load resets them (Q redrawn). A matrix whose P is non-finite (a NaN/Inf
gradient on some rank) comes out NaN, so GradScaler skips the step; it keeps
its previous error (M - G, where that is finite, else 0) and draws a fresh Q.

The P and Q phases depend on each other, so they run on the state's FIFO executor
thread, pipelined across buckets (ddpx/comm_hooks/twophase.py): every rank issues
P0, P1, Q0, P2, Q1, ..., Q last (torch 2.13's ``powerSGD_hook`` issues the Q
allreduce from a future callback, in completion order, and crashes on gloo
with several buckets). Wire per matrix: r (n + m)
fp32 elements instead of n m.

Rank with Adam (``rank: "auto"``, the default): 16 when the state is paired with
an Adam-family optimizer (it has ``betas``; ``state.pair(optimizer)``, which ``ddpx
train`` does before the first step), else 4. On the
transformer table of benchmarks/bench_convergence_gpt.py (a 4-block GPT, AdamW,
400 steps, seed 0) rank 4 lost 0.09 nats against allreduce, 8 0.045, 16 0.019,
32 0.004: Adam scales each coordinate by its own running magnitude, so the
coordinates a low-rank approximation leaves small are scaled up, and error
feedback does not repay that (the reason ``onebit`` fails with Adam). SGD does not
care (the digits matrix passes at 4). A state never paired fixes rank 4 at its
first layout (the first compressed step) and says so once; ``state_dict()`` keeps
the rank (``approx_rank``).

Options: ``rank`` (the approximation rank r, or "auto"), ``warmup_steps`` (plain
allreduce first, torch's ``start_powerSGD_iter``), ``min_numel`` (smaller
matrices travel uncompressed), ``seed``, ``piece_mb``. The native C++ twin
(csrc/comm_hooks/powersgd.cpp) runs the same ATen calls on the same layout.

Warm-up: a fixed count, 100 steps by default (torch's hook defaults to 1000
and advises about 10 % of training). On the convergence matrix of
benchmarks/bench_convergence.py (docs/comm_hooks.md) PowerSGD without warm-up
lost up to 10.9 points where a run has few steps or Adam meets a rank-4
gradient early (MLP, Adam, batch 128, 18 steps: -10.9; CNN, Adam, batch 128,
72 steps: -10.0; 2.5-3.6 in four more cells); with 100 steps every cell stayed
within 1.5 points (worst -1.4), as with 200. Pass ``warmup_steps=0`` to
compress from the first step.

Pieces: a bucket is handled in pieces of whole matrices of about ``piece_mb``
(default 16) MB of gradient, pipelined across the pieces (ddpx/comm_hooks/twophase.py):
P of the next piece is computed while this piece's P is reduced, and so on. A
matrix's P and Q need all of it, so a piece never cuts a matrix. 16 MB: the
P and Q messages are tiny (r (n + m) values per matrix), so every piece's two
collectives are latency, not bandwidth; one matrix (4 MB) per piece took 98
ms/step on the benchmark model with ``DDP(model)`` (2 hosts, 1 Gbit/s), 16 MB
or no split 63-66 (runs on a shared 2-core machine: +-10 % and worse). Per matrix
the arithmetic is the unsplit hook's; only the allreduces are per piece, which
is bit-identical with 2 ranks and may differ in the last bits with more (the
ring adds an element's copies in an order that depends on the buffer length).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import ops
from .options import LOSSY, SCOPE, Option, non_negative
from .registry import Method
from .state import ring_allreduce_bytes
from .twophase import Piece, TwoPhaseState


def _matrix_shape(p: torch.Tensor) -> tuple[int, int]:
    return p.shape[0], p.numel() // p.shape[0]


class PowerSGDState(TwoPhaseState):
    """Rank-r PowerSGD with error feedback and warm start."""

    keep_matrices_whole = True  # scope=inter_node: exact allreduce in the node, then this (ddpx/comm_hooks/scope.py)
    memories = ("error", "q", "p")  # error: the last step's M (see above); p: its P

    @property
    def approx_rank(self) -> int:
        """The approximation rank r (the option ``rank``; ``self.rank`` is the process's): the
        option, or for ``auto`` 16 when paired with an Adam-family optimizer, else 4."""
        return self.option("rank")

    def state_dict(self) -> dict:
        chosen = self.opts["rank"] != "auto" or self.auto_options.chosen("rank")
        return dict(super().state_dict(), approx_rank=self.approx_rank if chosen else None)

    def r_of(self, p: torch.Tensor) -> int:
        n, m = _matrix_shape(p)
        return min(self.approx_rank, n, m)

    def compressible(self, p):
        if p.dim() < 2 or p.numel() < self.opts["min_numel"]:
            return False
        n, m = _matrix_shape(p)
        return (n + m) * self.r_of(p) < n * m

    def build_layout(self, lay):
        f32 = dict(dtype=torch.float32, device=lay.params[0].device)
        tables, batches, p_total, q_total = self._piece_tables(lay)
        lay.matrices = torch.tensor([r for t in tables for r in t], dtype=torch.int64).reshape(-1, 8)
        lay.pbuf = torch.zeros(lay.n_plain + p_total, **f32)  # [plain | P's]: one allreduce per piece
        lay.q = torch.zeros(q_total, **f32)  # Q's (m x r each): allreduced, and the warm-start memory
        lay.qt = torch.zeros(q_total, **f32)  # the same Q's transposed (r x m): the kernels read rows of it
        lay.p_prev = torch.zeros(p_total, **f32)  # the last step's P's (not overwritten by the allreduce)
        lay.error = torch.zeros(lay.n_comp, **f32)
        for key, _, n, m, r, p_off, qoff, poff in lay.matrices.tolist():
            self.adopt("error", key, lay.error.narrow(0, poff, n * m))
            self.adopt("p", key, lay.p_prev.narrow(0, p_off, n * r))
            q = lay.q.narrow(0, qoff, m * r)
            self.adopt("q", key, q)
            if not q.any():  # new parameter, or memory reset: start from the seeded draw
                self._draw_q(key, q)
        lay.pieces = [self._piece(lay, j, len(tables), rows, spans)
                      for j, (rows, spans) in enumerate(zip(tables, batches))]

    def _piece_tables(self, lay):
        """(per piece its matrix table, per piece its shape batches, P and Q elements in all).
        A piece is a run of consecutive matrices of about ``piece_mb`` of gradient; each
        allreduces its own stretch of pbuf (the first also the exempt values) and of q.
        Within a piece, matrices of one shape (n, m, r) sit side by side in pbuf, q and qt
        (a batch: its first row and count), so one call orthogonalizes all their P's and one
        copy transposes all their Q's. Table rows: key, bucket_offset, n, m, r, p_offset,
        q_offset, packed_offset."""
        mats = []  # (key, bucket_offset, n, m, r, packed_offset), in bucket order
        off = 0
        for key, p, poff in zip(lay.keys, lay.params, lay.param_packed_offset):
            if poff is not None:
                mats.append((key, off, *_matrix_shape(p), self.r_of(p), poff))
            off += p.numel()
        groups, limit = [[]], self.opts["piece_mb"] * (1 << 20) / 4
        for row in mats:
            if groups[-1] and limit > 0 and sum(x[2] * x[3] for x in groups[-1]) >= limit:
                groups.append([])
            groups[-1].append(row)
        tables, batches, p_total, q_total = [], [], 0, 0
        for group in groups:
            shapes: dict[tuple, list] = {}
            for row in group:
                shapes.setdefault(row[2:5], []).append(row)
            rows, spans = [], []
            for (n, m, r), same in shapes.items():
                spans.append((len(rows), len(same)))
                for key, boff, _, _, _, poff in same:
                    rows.append((key, boff, n, m, r, p_total, q_total, poff))
                    p_total += n * r
                    q_total += m * r
            tables.append(rows)
            batches.append(spans)
        return tables, batches, p_total, q_total

    @staticmethod
    def _piece(lay, j: int, count: int, rows: list, spans: list) -> Piece:
        """Piece ``j`` of ``count``: its matrices (``rows``, batched by shape in ``spans``), its
        stretches of the layout's buffers, and views of them made once (the native hook makes
        its own)."""
        p0, q0 = (rows[0][5], rows[0][6]) if rows else (0, 0)
        p_len = sum(x[2] * x[4] for x in rows)
        q_len = sum(x[3] * x[4] for x in rows)
        pbuf = lay.pbuf.narrow(0, 0, lay.n_plain + p_len) if j == 0 else lay.pbuf.narrow(0, lay.n_plain + p0, p_len)
        pc = Piece(j, count, matrices=torch.tensor(rows, dtype=torch.int64).reshape(-1, 8),
                   batches=torch.tensor(spans, dtype=torch.int64).reshape(-1, 2), pbuf=pbuf,
                   q=lay.q.narrow(0, q0, q_len), p_prev=lay.p_prev.narrow(0, p0, p_len),
                   p=lay.pbuf.narrow(0, lay.n_plain + p0, p_len),
                   # which matrices had a finite P this step (phase 2 writes it, finish reads it)
                   finite=torch.ones(len(rows), dtype=torch.bool, device=lay.params[0].device))
        pc.views = [(key, boff, n, m, lay.error.narrow(0, poff, n * m).view(n, m),
                     lay.pbuf.narrow(0, lay.n_plain + p_off, n * r).view(n, r),
                     lay.p_prev.narrow(0, p_off, n * r).view(n, r), lay.qt.narrow(0, qoff, m * r).view(r, m),
                     lay.q.narrow(0, qoff, m * r).view(m, r))
                    for key, boff, n, m, r, p_off, qoff, poff in rows]
        pc.batch_views = []  # per shape: (P's [b, n, r], Q's [b, m, r], Q^T's [b, r, m], finite flags [b])
        for first, size in spans:
            key, boff, n, m, r, p_off, qoff, poff = rows[first]
            pc.batch_views.append((lay.pbuf.narrow(0, lay.n_plain + p_off, size * n * r).view(size, n, r),
                                   lay.q.narrow(0, qoff, size * m * r).view(size, m, r),
                                   lay.qt.narrow(0, qoff, size * m * r).view(size, r, m),
                                   pc.finite.narrow(0, first, size)))
        pc.finite_host = _host_flags(pc.finite)
        pc.finite_ready = None
        pc.grads = (None, [])  # (the bucket's data_ptr, its matrix views), remade when DDP's bucket changes
        return pc

    def _draw_q(self, key: int, q: torch.Tensor) -> None:
        g = torch.Generator().manual_seed(self.opts["seed"] * 1_000_003 + key)
        q.copy_(torch.randn(q.numel(), generator=g).view(q.shape))

    def load_state_dict(self, sd: dict) -> None:
        self.auto_options.restore("rank", sd.get("approx_rank"))  # a resumed run keeps the rank its memory has
        super().load_state_dict(sd)
        saved = sd.get("memory", {})
        if "error" in saved and "p" not in saved:  # saved before P was kept: its "error" is the error itself
            for t in self.memory["p"].values():
                t.zero_()
        # a reset (world-size change) zeroes the memory; Q must start random again
        for key, q in self.memory["q"].items():
            if q.numel() and not q.any():
                self._draw_q(key, q)

    def wire_bytes(self, lay) -> int:
        world = self.world_size
        return sum(ring_allreduce_bytes(4 * pc.pbuf.numel(), world) + ring_allreduce_bytes(4 * pc.q.numel(), world)
                   for pc in lay.pieces)

    @staticmethod
    def _grads(buf, pc):
        """The piece's gradient matrices: views of the bucket, made again only when DDP hands over a new buffer."""
        if pc.grads[0] != buf.data_ptr():
            pc.grads = (buf.data_ptr(), [buf.narrow(0, boff, n * m).view(n, m) for _, boff, n, m, *_ in pc.views])
        return pc.grads[1]

    def start_phase1(self, buf, lay, pc):
        """M = G + error feedback, P = M Q for every matrix of the piece (with the exempt values
        in the first piece), in one allreduce."""
        if pc.first:
            ops.flatten(lay.runs(buf, False), 1.0 / self.world_size, out=lay.pbuf.narrow(0, 0, lay.n_plain))
        for _, q, qt, _ in pc.batch_views:
            qt.copy_(q.transpose(1, 2))
        for grad, (key, _, _, _, error, p, p_prev, qt, q) in zip(self._grads(buf, pc), pc.views):
            ops.lowrank_project_(grad, error, p_prev, qt, p)  # error = (G + error) - P' Q'^T = M; P = M Q
        return dist.all_reduce(pc.pbuf, group=self.executor_group, async_op=True)

    def start_phase2(self, buf, lay, pc, reduce_p):
        """Orthogonalize the piece's P's, a batch per shape; Q = M^T P, all in one allreduce.
        Which P's were finite is noted for finish() without waiting for the device."""
        reduce_p.wait()
        for p, _, _, finite in pc.batch_views:
            torch.all(torch.isfinite(p).flatten(1), 1, out=finite)  # p is identical on every rank: so is the decision
            p.copy_(torch.linalg.qr(p).Q)  # a non-finite P comes out non-finite: finish() handles it
        pc.finite_ready = _copy_to_host(pc.finite, pc.finite_host)
        for key, _, _, _, error, p, p_prev, qt, q in pc.views:
            ops.lowrank_transpose_project_(error, p, qt)  # Q^T = P^T M, reading M row by row
        for _, q, qt, _ in pc.batch_views:
            q.copy_(qt.transpose(1, 2))
        return dist.all_reduce(pc.q, group=self.executor_group, async_op=True)

    def finish(self, buf, lay, pc, reduce_q):
        """P Q^T into the bucket, P kept for the next step; the exempt values back into the bucket."""
        reduce_q.wait()
        pc.q.mul_(1.0 / self.world_size)
        for _, q, qt, _ in pc.batch_views:
            qt.copy_(q.transpose(1, 2))
        if pc.finite_ready is not None:
            pc.finite_ready.synchronize()  # long done, as a rule: phase 2's flags, not the whole stream
        finite = pc.finite_host.tolist() if not bool(pc.finite_host.all()) else None
        for i, (grad, (key, _, _, _, error, p, p_prev, qt, q)) in enumerate(zip(self._grads(buf, pc), pc.views)):
            if finite is None or finite[i]:
                ops.lowrank_reconstruct_(grad, p, qt)
            else:  # a skipped step: back to the previous error, M - G (its rank's NaN/Inf elements restart at 0)
                error.sub_(grad).nan_to_num_(0.0, 0.0, 0.0)
                grad.fill_(float("nan"))
                self._draw_q(key, q)
        pc.p_prev.copy_(pc.p)
        if finite is not None:
            for i, (key, _, _, _, error, p, p_prev, qt, q) in enumerate(pc.views):
                if not finite[i]:
                    p_prev.zero_()
        if pc.first:
            ops.unflatten_(lay.pbuf.narrow(0, 0, lay.n_plain), lay.runs(buf, False))


def _host_flags(flags: torch.Tensor) -> torch.Tensor:
    """Where finish() reads the flags: the tensor itself on the CPU, pinned host memory on CUDA."""
    if flags.device.type == "cpu":
        return flags
    return torch.ones(flags.shape, dtype=flags.dtype, pin_memory=flags.device.type == "cuda")


def _copy_to_host(flags: torch.Tensor, host: torch.Tensor):
    """Start copying the flags to `host`; returns the CUDA event to wait for, or None."""
    if host is flags:
        return None
    if flags.device.type != "cuda":
        host.copy_(flags)
        return None
    host.copy_(flags, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return event


METHODS = (Method(
    "powersgd", PowerSGDState,
    options={
        "rank": Option(object, "auto", lambda v: None if v == "auto" or (type(v) is int and v >= 1) else
                       "must be 'auto' or an int >= 1", "approximation rank r; auto: 16 with an Adam-family "
                       "optimizer, else 4 (see the docstring)", auto=(4, 16)),
        "warmup_steps": Option(int, 100, non_negative,
                               "iterations of plain fp32 allreduce before compression starts (see the docstring)"),
        "min_numel": LOSSY["min_numel"],
        "seed": Option(int, 0, non_negative, "seed of the initial Q (identical on every rank)"),
        "piece_mb": Option(float, 16.0, non_negative,
                           "MB of fp32 gradient (whole matrices) per pipelined piece of a bucket (0: one piece)"),
        "scope": SCOPE,
    },
    native="powersgd"),)

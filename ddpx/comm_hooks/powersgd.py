"""``powersgd``: rank-r PowerSGD (Vogels et al., 2019) with error feedback and
warm start, on gloo and NCCL, with several buckets in flight.

Per bucket, every matrix-shaped gradient G (n x m, higher dims flattened to
n x prod(rest)) plus its error feedback, M, is approximated as P Q^T:

1. M = G + (the previous step's M - P' Q'^T), P = M Q for every matrix; all
   P's of the bucket and the uncompressed parameters (vectors, small tensors;
   fp32, pre-divided by world) go in one buffer and one allreduce.
2. Orthogonalize each P (``torch.linalg.qr``), Q = M^T P; all Q's in one
   allreduce, divided by world.
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

The P and Q phases depend on each other, so they run on the state's FIFO worker
thread, pipelined across buckets (ddpx/comm_hooks/twophase.py): every rank issues
P0, P1, Q0, P2, Q1, ..., Q last (torch 2.13's ``powerSGD_hook`` issues the Q
allreduce from a future callback, in completion order, and crashes on gloo
with several buckets). Wire per matrix: r (n + m)
fp32 elements instead of n m.

Options: ``rank`` (the approximation rank r), ``warmup_steps`` (plain
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
from .base import HookState, LossyState, Option, non_negative, ring_allreduce_bytes
from .twophase import Piece, TwoPhaseState


def _matrix_shape(p: torch.Tensor) -> tuple[int, int]:
    return p.shape[0], p.numel() // p.shape[0]


class PowerSGDState(TwoPhaseState):
    """Rank-r PowerSGD with error feedback and warm start."""

    name = "powersgd"
    native_kind = "powersgd"
    options = {
        "rank": Option(int, 4, lambda v: None if v >= 1 else "must be >= 1", "approximation rank r"),
        "warmup_steps": Option(int, 100, non_negative,
                               "iterations of plain fp32 allreduce before compression starts (see the docstring)"),
        "min_numel": LossyState.options["min_numel"],
        "seed": Option(int, 0, non_negative, "seed of the initial Q (identical on every rank)"),
        "piece_mb": Option(float, 16.0, non_negative,
                           "MB of fp32 gradient (whole matrices) per pipelined piece of a bucket (0: one piece)"),
        "scope": LossyState.options["scope"],
    }
    keep_matrices_whole = True  # scope=inter_node: exact allreduce in the node, then this (ddpx/comm_hooks/scope.py)
    memories = ("error", "q", "p")  # error: the last step's M (see above); p: its P

    # HookState.rank is the process rank; the option of the same name (the
    # user-facing spelling, as in the paper) is stored as `approx_rank`.
    @property
    def rank(self) -> int:
        return HookState.rank.fget(self)

    @rank.setter
    def rank(self, value: int) -> None:
        self.approx_rank = value

    def r_of(self, p: torch.Tensor) -> int:
        n, m = _matrix_shape(p)
        return min(self.approx_rank, n, m)

    def compressible(self, p):
        if p.dim() < 2 or p.numel() < self.min_numel:
            return False
        n, m = _matrix_shape(p)
        return (n + m) * self.r_of(p) < n * m

    def build_layout(self, lay):
        dev = lay.params[0].device
        f32 = dict(dtype=torch.float32, device=dev)
        mats = []  # (key, bucket_offset, n, m, r, p_offset, q_offset, packed_offset)
        p_total = q_total = 0
        off = 0
        for key, p, poff in zip(lay.keys, lay.params, lay.param_packed_offset):
            if poff is not None:
                n, m = _matrix_shape(p)
                r = self.r_of(p)
                mats.append((key, off, n, m, r, p_total, q_total, poff))
                p_total += n * r
                q_total += m * r
            off += p.numel()
        lay.matrices = torch.tensor(mats, dtype=torch.int64).reshape(-1, 8)  # also read by the C++ hook
        lay.pbuf = torch.zeros(lay.n_plain + p_total, **f32)  # [plain | P's]: one allreduce
        lay.q = torch.zeros(q_total, **f32)  # Q's: one allreduce, and the warm-start memory
        # scratch for one matrix's Q^T (r x m): every pass then reads M row by row
        lay.qt = torch.zeros(max([m * r for _, _, _, m, r, *_ in mats], default=0), **f32)
        lay.p_prev = torch.zeros(p_total, **f32)  # the last step's P's (not overwritten by the allreduce)
        lay.error = torch.zeros(lay.n_comp, **f32)
        for key, _, n, m, r, p_off, qoff, poff in mats:
            self.adopt("error", key, lay.error.narrow(0, poff, n * m))
            self.adopt("p", key, lay.p_prev.narrow(0, p_off, n * r))
            q = lay.q.narrow(0, qoff, m * r)
            self.adopt("q", key, q)
            if not q.any():  # new parameter, or memory reset: start from the seeded draw
                self._draw_q(key, q)
        # pieces: runs of consecutive matrices of about piece_mb of gradient; each
        # allreduces its own stretch of pbuf (the first also the exempt values) and of q
        groups, limit = [[]], self.piece_mb * (1 << 20) / 4
        for row in mats:
            if groups[-1] and limit > 0 and sum(x[2] * x[3] for x in groups[-1]) >= limit:
                groups.append([])
            groups[-1].append(row)
        lay.pieces = []
        for j, group in enumerate(groups):
            p0 = group[0][5] if group else 0
            q0 = group[0][6] if group else 0
            p_len = sum(x[2] * x[4] for x in group)
            q_len = sum(x[3] * x[4] for x in group)
            lay.pieces.append(Piece(
                j, len(groups), matrices=torch.tensor(group, dtype=torch.int64).reshape(-1, 8),
                pbuf=lay.pbuf.narrow(0, 0, lay.n_plain + p_len) if j == 0 else lay.pbuf.narrow(0, lay.n_plain + p0,
                                                                                                 p_len),
                q=lay.q.narrow(0, q0, q_len)))

    def _draw_q(self, key: int, q: torch.Tensor) -> None:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + key)
        q.copy_(torch.randn(q.numel(), generator=g))

    def load_state_dict(self, sd: dict) -> None:
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

    def _matrices(self, buf, lay, pc):
        """(key, gradient, error, P, previous P, Q, Q^T scratch) views for every compressed matrix of the piece."""
        out = []
        for key, off, n, m, r, p_off, q_off, poff in pc.matrices.tolist():
            out.append((key, buf.narrow(0, off, n * m).view(n, m), lay.error.narrow(0, poff, n * m).view(n, m),
                        lay.pbuf.narrow(0, lay.n_plain + p_off, n * r).view(n, r),
                        lay.p_prev.narrow(0, p_off, n * r).view(n, r),
                        lay.q.narrow(0, q_off, m * r).view(m, r), lay.qt.narrow(0, 0, m * r).view(r, m)))
        return out

    def start_phase1(self, buf, lay, pc):
        """M = G + error feedback, P = M Q for every matrix of the piece (with the exempt values
        in the first piece), in one allreduce."""
        if pc.first:
            ops.flatten(lay.runs(buf, False), 1.0 / self.world_size, out=lay.pbuf.narrow(0, 0, lay.n_plain))
        for key, grad, error, p, p_prev, q, qt in self._matrices(buf, lay, pc):
            qt.copy_(q.t())
            ops.lowrank_project_(grad, error, p_prev, qt, p)  # error = (G + error) - P' Q'^T = M; P = M Q
        return dist.all_reduce(pc.pbuf, group=self.worker_group, async_op=True)

    def start_phase2(self, buf, lay, pc, reduce_p):
        """Orthogonalize every P of the piece, Q = M^T P, all in one allreduce."""
        reduce_p.wait()
        pc.finite = []
        for key, grad, error, p, p_prev, q, qt in self._matrices(buf, lay, pc):
            ok = bool(torch.isfinite(p).all())  # p is identical on every rank: so is the decision
            pc.finite.append(ok)
            if ok:
                p.copy_(torch.linalg.qr(p).Q)
            ops.lowrank_transpose_project_(error, p, qt)  # Q^T = P^T M, reading M row by row
            q.copy_(qt.t())
        return dist.all_reduce(pc.q, group=self.worker_group, async_op=True)

    def finish(self, buf, lay, pc, reduce_q):
        """P Q^T into the bucket, P kept for the next step; the exempt values back into the bucket."""
        reduce_q.wait()
        pc.q.mul_(1.0 / self.world_size)
        for ok, (key, grad, error, p, p_prev, q, qt) in zip(pc.finite, self._matrices(buf, lay, pc)):
            if ok:
                qt.copy_(q.t())
                ops.lowrank_reconstruct_(grad, p, qt)
                p_prev.copy_(p)
            else:  # a skipped step: back to the previous error, M - G (its rank's NaN/Inf elements restart at 0)
                error.sub_(grad).nan_to_num_(0.0, 0.0, 0.0)
                p_prev.zero_()
                grad.fill_(float("nan"))
                self._draw_q(key, q)
        if pc.first:
            ops.unflatten_(lay.pbuf.narrow(0, 0, lay.n_plain), lay.runs(buf, False))


HOOKS = {"powersgd": PowerSGDState}

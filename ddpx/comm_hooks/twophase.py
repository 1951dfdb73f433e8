"""The bucket pipeline of the hooks that need two dependent collectives per
bucket: ``int8`` and ``onebit`` (all-to-all of codes, local average, all-gather
of the averages) and ``powersgd`` (allreduce P, orthogonalize, allreduce Q).

Gloo runs a group's collectives one after another, so a rank that waits for a
bucket's second collective before it starts the next bucket's first leaves
the link idle while it computes. The executor job of bucket i therefore

* starts bucket i (code it, start its first collective: ``start_phase1``),
* advances bucket i-1 (wait for that, compute, start its second collective:
  ``start_phase2``),
* finishes bucket i-2 (wait for the second collective, write the bucket:
  ``finish``),

and the last bucket's job also advances it and finishes everything left. Every
rank starts the collectives in one order: C1 0, C1 1, C2 0, C1 2, C2 1, ...,
C2 last (the C++ twin: ``TwoPhaseAlgorithm`` in csrc/comm_hooks/native_hook.h).

Pieces. A bucket is coded only once DDP hands all of it over, and DDP's default
buckets are 25 MB: unsplit, the link idles while such a bucket is coded and the
CPU idles while it is on the wire. Each layout is therefore cut into pieces of
about ``piece_mb`` of fp32 gradient (``layout.pieces``, built by the hook's
``build_layout``) and the pipeline above runs piece by piece, across the pieces
of a bucket and on into the next bucket: piece i+1 is coded while piece i is on
the wire, and pieces are decoded as they arrive. The bucket's future completes
with its last piece. What a piece is depends on the algorithm: for int8 and
onebit, the same range of blocks (chunks) of every rank's segment of the
unsplit bucket, so the blocks, codes and error memory are the unsplit hook's
and the results are bit-identical to it; for powersgd, a run of the bucket's
matrices (see its docstring).

``scope: inter_node`` (ddpx/comm_hooks/scope.py) runs this pipeline too, with the
node-local stages around the phases of a state of the hook's own class (``Pipelined``
is the pipeline, ``Scoped`` the scope's dispatch).
"""

from __future__ import annotations

import torch.distributed as dist

from typing import Any

from .allreduce import allreduce_average
from .state import LossyState, profiled

_UNRESOLVED = object()

# torch 2.13 renamed all_gather_into_tensor (deprecated there, with a warning on every call)
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def segment_spans(slices, seg: int, unit: int) -> list:
    """Spans ``(rank, bucket offset, numel, segment offset)`` covering the compressed
    values, packed in the order of ``slices`` (``[(bucket offset, numel)]``) and cut
    into per-rank segments of ``seg`` elements, so a hook can code straight from and
    finish straight into the bucket without packing copies. Empty unless every slice
    is whole ``unit``s (blocks, chunks; ``seg`` is too): then every span is, and coding
    span by span gives the packed buffer's bits."""
    if not all(n % unit == 0 for _, n in slices):
        return []
    spans, packed = [], 0
    for boff, n in slices:
        while n:
            r, soff = divmod(packed, seg)
            take = min(n, seg - soff)
            spans.append((r, boff, take, soff))
            boff, n, packed = boff + take, n - take, packed + take
    return spans


def piece_elements(piece_mb: float, world: int, unit: int) -> int:
    """Elements of each rank's segment per piece: ``piece_mb`` of fp32 gradient over
    all ranks, in whole ``unit``s (at least one); 0 for ``piece_mb == 0`` (no split)."""
    if piece_mb <= 0:
        return 0
    per_rank = int(piece_mb * (1 << 20)) // 4 // world
    return max(1, per_rank // unit) * unit


def piece_ranges(seg: int, length: int) -> list:
    """``[(start, numel)]`` cutting a segment of ``seg`` elements into pieces of
    ``length`` (the last may be shorter); one piece when ``length`` is 0 or the
    segment is empty or short."""
    if length <= 0 or seg <= length:
        return [(0, seg)]
    return [(a, min(length, seg - a)) for a in range(0, seg, length)]


def piece_spans(spans: list, start: int, numel: int) -> list:
    """The spans ``(rank, bucket offset, numel, segment offset)`` restricted to segment
    offsets [start, start + numel), with segment offsets relative to ``start``."""
    out = []
    for r, boff, n, soff in spans:
        lo, hi = max(soff, start), min(soff + n, start + numel)
        if lo < hi:
            out.append((r, boff + lo - soff, hi - lo, lo - start))
    return out


class Piece:
    """One piece of a bucket layout (see the module docstring): plain attributes
    (ints and tensors) that the phase functions read, and the C++ hook too."""

    def __init__(self, index: int, count: int, **attrs):
        self.index = index
        self.first = int(index == 0)
        self.last = int(index == count - 1)
        self.__dict__.update(attrs)


class Scoped:
    """Mixin of the states with a ``scope`` option (ddpx/comm_hooks/scope.py): resolves it
    once, at the first bucket or ``ddpx.comm_hooks.register`` (the same point on every
    rank: the first resolution is a collective), hands ``inter_node`` layouts out and
    dispatches each bucket (``run_bucket``); a hook implements ``run_global``."""

    _plan: Any = _UNRESOLVED

    def scope_plan(self):
        """None (global), ``scope.EXACT`` or the ``scope.InterNode`` plan."""
        if self._plan is _UNRESOLVED:
            from .scope import resolve

            self._plan = resolve(self)
        return self._plan

    def inter_node(self):
        """The ``scope.InterNode`` plan, or None."""
        plan = self.scope_plan()
        return plan if isinstance(plan, Pipelined) else None

    def layout(self, index, params):
        plan = self.inter_node()
        if plan is None:
            return super().layout(index, params)
        self.auto_options.use()  # before the plan cuts shards of whole coding units
        return plan.layout(index, params)

    def run_bucket(self, bucket):
        """Warm-up, and inter_node on one node: the exact average; inter_node: its plan;
        else the hook's own ``run_global`` on the bucket's buffer and layout, counted."""
        plan = self.scope_plan()
        if self.warming_up() or plan == "exact":
            return allreduce_average(self, bucket)
        if plan is not None:
            return plan.run_bucket(bucket)
        buf = bucket.buffer()
        lay = self.layout(bucket.index(), bucket.parameters())
        last = bucket.is_last()
        self.count(buf.numel(), self.wire_bytes(lay), last)
        return self.run_global(buf, lay, last)

    def run_global(self, buf, lay, last: bool):
        """The bucket's future with scope global."""
        raise NotImplementedError


class Pipelined:
    """The piece pipeline of the module docstring over ``start_phase1``, ``start_phase2``
    and ``finish`` (the two-phase states' own, or ``scope.InterNode``'s around them)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._advancing = None  # the job whose second collective the next job starts
        self._finishing: list = []  # jobs whose second collective is in flight

    def _pipeline(self, buf, lay, last, fut):
        """The executor job of one bucket: its pieces, one pipeline step each."""
        for pc in lay.pieces:
            self._step([buf, lay, pc, None, fut], last and pc.last)

    @staticmethod
    def _fail(job, exc):
        if not job[4].done():
            job[4].set_exception(exc)

    def _step(self, started, last):
        """One pipeline step (see the module docstring). A job is [buf, layout, piece,
        pending collective, the bucket's future]; a failure completes the bucket's
        future with the exception (it surfaces in loss.backward()); the last piece's
        success completes it with the bucket."""
        advancing, self._advancing = self._advancing, None
        finishing, self._finishing = self._finishing, []
        try:
            with profiled("ddpx::encode"):
                started[3] = self.start_phase1(started[0], started[1], started[2])
        except BaseException as exc:
            for job in ([advancing] if advancing else []) + finishing:
                self._fail(job, exc)
            raise
        for job in ([advancing] if advancing else []) + ([started] if last else []):
            try:
                with profiled("ddpx::collective"):
                    job[3] = self.start_phase2(job[0], job[1], job[2], job[3])
            except BaseException as exc:
                self._fail(job, exc)
            else:
                finishing.append(job)
        if not last:
            self._advancing = started
        keep = 0 if last else 1  # the second collective just started is finished by the next step
        while len(finishing) > keep:
            job = finishing.pop(0)
            try:
                with profiled("ddpx::decode"):
                    self.finish(job[0], job[1], job[2], job[3])
            except BaseException as exc:
                self._fail(job, exc)
            else:
                if job[2].last and not job[4].done():
                    job[4].set_result(job[0])
        self._finishing = finishing


class TwoPhaseState(Scoped, Pipelined, LossyState):
    multi_phase = True

    def start_phase1(self, buf, lay, pc):
        """Code piece `pc` of the bucket; return its first collective, started."""
        raise NotImplementedError

    def start_phase2(self, buf, lay, pc, first):
        """Wait for the piece's first collective, compute; return the second, started."""
        raise NotImplementedError

    def finish(self, buf, lay, pc, second):
        """Wait for the piece's second collective, write its result into the bucket."""
        raise NotImplementedError

    def result_message(self, lay, pc):
        """The buffer the piece's ``finish`` decodes: the all-gathered codes (for
        scope=inter_node's stage 3, ddpx/comm_hooks/scope.py)."""
        return pc.recv2

    def wire_bytes(self, lay) -> int:
        """Bytes this rank sends per step for the bucket (``stats()``); the all-to-all
        + all-gather hooks send (R-1)/R of each piece's R-row message twice."""
        return sum(2 * (self.world_size - 1) * pc.piece for pc in lay.pieces)

    def run_global(self, buf, lay, last):
        return self.executor().submit_deferred(lambda fut: self._pipeline(buf, lay, last, fut), buf.device)

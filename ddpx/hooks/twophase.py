"""The bucket pipeline of the hooks that need two dependent collectives per
bucket: ``int8`` and ``onebit`` (all-to-all of codes, local average, all-gather
of the averages) and ``powersgd`` (allreduce P, orthogonalize, allreduce Q).

Gloo runs a group's collectives one after another, so a rank that waits for a
bucket's second collective before it starts the next bucket's first leaves
the link idle while it computes. The worker job of bucket i therefore

* starts bucket i (code it, start its first collective: ``start_phase1``),
* advances bucket i-1 (wait for that, compute, start its second collective:
  ``start_phase2``),
* finishes bucket i-2 (wait for the second collective, write the bucket:
  ``finish``),

and the last bucket's job also advances it and finishes everything left. Every
rank starts the collectives in one order: C1 0, C1 1, C2 0, C1 2, C2 1, ...,
C2 last (the C++ twin: ``TwoPhaseAlgorithm`` in csrc/hooks/native_hook.h).
"""

from __future__ import annotations

import torch.distributed as dist

from .allreduce import allreduce_average
from .base import LossyState

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


class TwoPhaseState(LossyState):
    multi_phase = True

    def __init__(self, process_group=None, **opts):
        super().__init__(process_group, **opts)
        self._advancing = None  # the job whose second collective the next job starts
        self._finishing: list = []  # jobs whose second collective is in flight

    def start_phase1(self, buf, lay):
        """Code the bucket; return its first collective, started."""
        raise NotImplementedError

    def start_phase2(self, buf, lay, first):
        """Wait for the first collective, compute; return the second, started."""
        raise NotImplementedError

    def finish(self, buf, lay, second):
        """Wait for the second collective, write the result into the bucket."""
        raise NotImplementedError

    def wire_bytes(self, lay) -> int:
        """Bytes this rank sends per step for the bucket (``stats()``); the all-to-all
        + all-gather hooks send (R-1)/R of their R-piece message twice."""
        return 2 * (self.world_size - 1) * lay.piece

    def run_bucket(self, bucket):
        if self.warming_up():
            return allreduce_average(self, bucket)
        buf = bucket.buffer()
        lay = self.layout(bucket.index(), bucket.parameters())
        last = bucket.is_last()
        self.count(buf.numel(), self.wire_bytes(lay), last)
        return self.worker().submit_deferred(lambda fut: self._pipeline(buf, lay, last, fut), buf.device)

    def _pipeline(self, buf, lay, last, fut):
        """The worker job of one bucket (see the module docstring). A job is
        [buf, layout, pending collective, future]; a failure completes that
        bucket's future with the exception (it surfaces in loss.backward())."""
        advancing, self._advancing = self._advancing, None
        finishing, self._finishing = self._finishing, []
        try:
            started = [buf, lay, self.start_phase1(buf, lay), fut]
        except BaseException as exc:
            for job in ([advancing] if advancing else []) + finishing:
                job[3].set_exception(exc)
            raise
        for job in ([advancing] if advancing else []) + ([started] if last else []):
            try:
                job[2] = self.start_phase2(job[0], job[1], job[2])
            except BaseException as exc:
                job[3].set_exception(exc)
            else:
                finishing.append(job)
        if not last:
            self._advancing = started
        keep = 0 if last else 1  # the second collective just started is finished by the next job
        while len(finishing) > keep:
            job_buf, job_lay, second, job_fut = finishing.pop(0)
            try:
                self.finish(job_buf, job_lay, second)
            except BaseException as exc:
                job_fut.set_exception(exc)
            else:
                job_fut.set_result(job_buf)
        self._finishing = finishing

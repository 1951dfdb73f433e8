"""The two-phase hooks' bucket pipeline (``int8``, ``onebit``).

Their codes are not summable, so a bucket is reduced by hand: an all-to-all
sends every rank its segment (phase 1), each rank averages its segment and an
all-gather hands the averages to everyone (phase 2). Gloo runs a group's
collectives one after another, so a rank that waits for a bucket's all-gather
before it starts the next bucket's all-to-all leaves the link idle while it
codes. The worker job of bucket i therefore

* starts bucket i (encode, all-to-all),
* reduces bucket i-1 (wait for its all-to-all, average, start its all-gather),
* decodes bucket i-2 (wait for its all-gather, write the bucket),

and the last bucket's job also reduces it and decodes everything left. Every
rank issues A2A 0, A2A 1, AG 0, A2A 2, AG 1, ..., AG last, in that order.

A subclass implements ``start_exchange``, ``reduce_and_gather`` and ``decode``
(the C++ twin: ``TwoPhaseAlgorithm`` in csrc/hooks/native_hook.h).
"""

from __future__ import annotations

from .allreduce import allreduce_average
from .base import LossyState


class TwoPhaseState(LossyState):
    multi_phase = True

    def start_exchange(self, buf, lay):
        """Encode the bucket into ``lay.send``; return the started all-to-all."""
        raise NotImplementedError

    def reduce_and_gather(self, buf, lay, exchange):
        """Wait for the all-to-all, average this rank's segment into ``lay.send2``;
        return the started all-gather."""
        raise NotImplementedError

    def decode(self, buf, lay, gather):
        """Wait for the all-gather, write every averaged segment into the bucket."""
        raise NotImplementedError

    def run_bucket(self, bucket):
        if self.warming_up():
            return allreduce_average(self, bucket)
        buf = bucket.buffer()
        lay = self.layout(bucket.index(), bucket.parameters())
        last = bucket.is_last()
        self.count(buf.numel(), 2 * (self.world_size - 1) * lay.piece, last)
        return self.worker().submit_deferred(lambda fut: self._pipeline(buf, lay, last, fut), buf.device)

    def _pipeline(self, buf, lay, last, fut):
        """The worker job of one bucket (see the module docstring). A job is
        [buf, layout, pending collective, future]; a failure completes that
        bucket's future with the exception (it surfaces in loss.backward())."""
        reducing, self._reducing = getattr(self, "_reducing", None), None
        decoding, self._decoding = getattr(self, "_decoding", None) or [], []
        try:
            started = [buf, lay, self.start_exchange(buf, lay), fut]
        except BaseException as exc:
            for job in ([reducing] if reducing else []) + decoding:
                job[3].set_exception(exc)
            raise
        for job in ([reducing] if reducing else []) + ([started] if last else []):
            try:
                job[2] = self.reduce_and_gather(job[0], job[1], job[2])
            except BaseException as exc:
                job[3].set_exception(exc)
            else:
                decoding.append(job)
        if not last:
            self._reducing = started
        keep = 0 if last else 1  # the all-gather just started is decoded by the next job
        while len(decoding) > keep:
            job_buf, job_lay, gather, job_fut = decoding.pop(0)
            try:
                self.decode(job_buf, job_lay, gather)
            except BaseException as exc:
                job_fut.set_exception(exc)
            else:
                job_fut.set_result(job_buf)
        self._decoding = decoding

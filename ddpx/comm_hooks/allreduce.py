"""``allreduce``: exact fp32 averaging, bit-identical to DDP without a hook.

Each rank scales its bucket by 1/world (the same multiply DDP does when it
copies gradients into the bucket) and one allreduce sums it in place; the
bucket is the result, so there is no copy back. Also the warm-up path of the
lossy hooks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .registry import Method
from .state import HookState, ring_allreduce_bytes


def allreduce_average(state: HookState, bucket) -> torch.futures.Future:
    """Average the bucket in place across the state's process group."""
    buf = bucket.buffer()
    world = state.world_size
    state.count(buf.numel(), ring_allreduce_bytes(buf.numel() * buf.element_size(), world), bucket.is_last())
    buf.mul_(1.0 / world)
    fut = dist.all_reduce(buf, group=state.process_group, async_op=True).get_future()

    def finish(done):
        done.value()  # re-raises a failed collective
        return buf

    return fut.then(finish)


class AllreduceState(HookState):
    """Plain fp32 allreduce (average). No options."""

    def run_bucket(self, bucket):
        return allreduce_average(self, bucket)


METHODS = (Method("allreduce", AllreduceState, native="allreduce"),)

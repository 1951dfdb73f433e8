"""``onebit_adam``: the comm hook of 1-bit Adam (``ddpx.optim.OneBitAdam``).

Why a hook of its own. Adam divides by the root of its second moment, which is
nonlinear in the gradient: error feedback on a 1-bit *gradient* (the ``onebit``
hook) repays the compression error into the gradient sum, but not into Adam's
update, and a small GPT with AdamW lost 0.41 nats with it (docs/comm_hooks.md).
1-bit Adam (Tang et al. 2021, DeepSpeed) compresses what Adam's update is linear
in instead: after an exact warm-up it freezes the second moment and sends the
*momentum*, 1-bit with error feedback on the worker and the server side.

The work is split between this hook and the optimizer:

* warm-up (the first ``warmup_steps`` iterations): the hook averages the
  gradients exactly (fp32 allreduce) and ``OneBitAdam`` steps as ``AdamW``;
* compressed stage: the hook sends no gradient at all, so DDP's own allreduce is
  not sent twice; each rank keeps its local gradient. ``OneBitAdam`` folds it into
  its momentum, divides that by Adam's frozen denominator and calls
  :meth:`OneBitAdamState.average`, which averages every rank's update with the
  ``onebit`` hook's two-phase compressed allreduce
  (signs + one scale per ``chunk_size`` elements, worker and server error
  feedback, pieces pipelined on the executor, the same kernels and profiler
  phases), and steps with it (ddpx/optim.py says why the update travels, not the
  momentum).

Non-finite gradients. Gradients stay local in the compressed stage, so one rank
could see an inf that the others do not, and a GradScaler would then skip the
step on that rank only (the next update exchange would hang). Each bucket
therefore allreduces one "non-finite here" flag (4 bytes) and a flagged bucket
gets a NaN on every rank: every rank skips the step together.

State: the step counter and the error memories (per parameter, per rank: one
``state_dict()`` per rank; a different world size on load resets the memory with
a warning), as the ``onebit`` hook keeps them. Adam's moments are the
optimizer's (identical on every rank). Python hook only: in its compressed stage
the hook does next to nothing, and the update exchange runs the native kernels.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import ops
from ..errors import DdpxError
from .allreduce import allreduce_average
from .onebit import OnebitState
from .options import Option, non_negative, positive_multiple_of
from .registry import Method
from .state import ring_allreduce_bytes

# the layout index of the optimizer's "bucket" (DDP's buckets are 0, 1, ...)
OPTIMIZER_BUCKET = -1


class OneBitAdamState(OnebitState):
    """Exact allreduce during the warm-up, then local gradients and OneBitAdam's 1-bit update exchange."""

    warmup_text = ("exact allreduce and AdamW steps for the first {n} steps; from step {n} Adam's second moment "
                   "is frozen and the updates travel 1-bit")

    def __init__(self, method, process_group=None, **opts):
        super().__init__(method, process_group, **opts)
        # whether the hook's latest step left the gradients local (the optimizer then exchanges its update)
        self.compressing = False

    def pair(self, optimizer) -> None:
        """Pair with its ``ddpx.optim.OneBitAdam`` (any other optimizer is refused in one line),
        which then averages its updates through :meth:`average`; ``OneBitAdam(...,
        comm=state)`` and ``OneBitAdam.pair(state)`` come here."""
        super().pair(optimizer)
        optimizer.comm = self

    def run_bucket(self, bucket):
        self.compressing = not self.warming_up()
        if not self.compressing:
            return allreduce_average(self, bucket)
        buf = bucket.buffer()
        self.count(buf.numel(), ring_allreduce_bytes(4, self.world_size), bucket.is_last())
        flag = torch.logical_not(torch.isfinite(buf).all()).to(torch.float32).reshape(1)
        fut = dist.all_reduce(flag, group=self.process_group, async_op=True).get_future()

        def finish(done):
            done.value()  # re-raises a failed collective
            # a NaN in the first element is enough for GradScaler and the non-finite guard
            buf[:1].add_(torch.where(flag > 0, float("nan"), 0.0))
            return buf

        return fut.then(finish)

    def average(self, params: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
        """Replace every rank's ``tensors`` (one per parameter of ``params``, the same list
        on every rank: OneBitAdam's updates) by their average over the ranks, 1-bit
        compressed with worker and server error feedback kept per parameter (parameters
        under ``min_numel`` and vectors: exact), in place."""
        lay = self.layout(OPTIMIZER_BUCKET, params)
        for t in tensors:
            if t.dtype != torch.float32:
                raise DdpxError(f"ddpx.optim.OneBitAdam: a parameter of dtype {t.dtype}; 1-bit Adam needs float32 "
                                "parameters (keep the model in fp32 and use amp.enabled for bf16/fp16)")
        ops.flatten(tensors, out=lay.flat)
        self.counters[1] += self.wire_bytes(lay)
        self.run_global(lay.flat, lay, True).wait()
        ops.unflatten_(lay.flat, tensors)

    def build_layout(self, lay):
        super().build_layout(lay)
        lay.flat = torch.empty(lay.numel, dtype=torch.float32, device=lay.params[0].device)  # the "bucket"


METHODS = (Method(
    "onebit_adam", OneBitAdamState,
    options={
        "warmup_steps": Option(int, 100, lambda v: None if v >= 1 else "must be >= 1 (Adam's second moment is "
                               "frozen at its end)", "iterations of exact allreduce and AdamW steps before the "
                               "second moment is frozen"),
        "min_numel": Option(int, 16384, non_negative, "parameters with fewer elements send their update exactly"),
        "compress_vectors": Option(bool, False, None, "compress 1-D parameters' update (biases, norms) too"),
        "chunk_size": Option(int, 128, positive_multiple_of(8), "elements per fp32 scale"),
        "piece_mb": Option(float, 16.0, non_negative, "MB of fp32 update per pipelined piece (0: one piece)"),
    },
    # Python hook only: in its compressed stage the hook does next to nothing, and the update
    # exchange runs the native kernels
    native=None,
    # the gradients are averaged by the optimizer, not the hook, once compression starts
    optimizer="ddpx.optim.OneBitAdam"),)

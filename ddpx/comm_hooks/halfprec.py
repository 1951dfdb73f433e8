"""``fp16`` and ``bf16``: the bucket travels as a 16-bit allreduce.

Each compressed run of the bucket is scaled by 1/world and cast in one pass
(``ddpx.ops.scale_cast``) into a 16-bit send buffer, so the sum cannot
overflow where the average would not; the return path casts back and writes
straight into the bucket (``ddpx.ops.cast_scale_copy_``). Exempt parameters
(small and 1-D ones by default) are averaged exactly in a second fp32
allreduce issued right after, in the same hook call. Non-finite values stay
non-finite (an overflow in the cast becomes inf), so GradScaler sees them.
Wire: 2 bytes per compressed element.

Under ``trainer.strategy: fsdp`` the same cast is FSDP2's gradient reduce-scatter
(``HalfPrecisionReduceScatter``, ddpx/comm_hooks/reduce_scatter.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import ops
from .options import LOSSY
from .reduce_scatter import CompressedReduceScatter
from .registry import Method
from .state import LossyState, ring_allreduce_bytes
from .twophase import Piece, Scoped


class HalfPrecisionState(Scoped, LossyState):
    dtype = torch.float16

    def build_layout(self, lay):
        dev = lay.params[0].device
        lay.wire = torch.empty(lay.n_comp, dtype=self.dtype, device=dev)
        lay.plain = torch.empty(lay.n_plain, dtype=torch.float32, device=dev)
        lay.pieces = [Piece(0, 1)]

    def wire_bytes(self, lay) -> int:
        return ring_allreduce_bytes(2 * lay.n_comp + 4 * lay.n_plain, self.world_size)

    def run_global(self, buf, lay, last):
        world, group = self.world_size, self.process_group
        inv = 1.0 / world
        futs = []
        if lay.n_comp:
            for off, n, poff in lay.comp_runs:
                ops.scale_cast(buf.narrow(0, off, n), inv, self.dtype, out=lay.wire.narrow(0, poff, n))
            futs.append(dist.all_reduce(lay.wire, group=group, async_op=True).get_future())
        if lay.n_plain:
            ops.flatten(lay.runs(buf, False), inv, out=lay.plain)
            futs.append(dist.all_reduce(lay.plain, group=group, async_op=True).get_future())

        def finish(done):
            for f in done.value():
                f.value()  # re-raises a failed collective
            for off, n, poff in lay.comp_runs:
                ops.cast_scale_copy_(buf.narrow(0, off, n), lay.wire.narrow(0, poff, n), 1.0)
            if lay.n_plain:
                ops.unflatten_(lay.plain, lay.runs(buf, False))
            return buf

        return torch.futures.collect_all(futs).then(finish)

    # The two-phase shape (ddpx/comm_hooks/twophase.py) of the compressed values alone, for
    # stage 2 of scope=inter_node, whose shard has no exempt values: one allreduce.
    def start_phase1(self, buf, lay, pc):
        for off, n, poff in lay.comp_runs:
            ops.scale_cast(buf.narrow(0, off, n), 1.0 / self.world_size, self.dtype, out=lay.wire.narrow(0, poff, n))
        return dist.all_reduce(lay.wire, group=self.executor_group, async_op=True)

    def result_message(self, lay, pc):
        return lay.wire  # the summed 16-bit values

    def start_phase2(self, buf, lay, pc, reduce):
        return reduce  # no second collective

    def finish(self, buf, lay, pc, reduce):
        reduce.wait()
        for off, n, poff in lay.comp_runs:
            ops.cast_scale_copy_(buf.narrow(0, off, n), lay.wire.narrow(0, poff, n), 1.0)


class Fp16State(HalfPrecisionState):
    """IEEE half precision (range +-65504 after the 1/world scaling)."""

    dtype = torch.float16


class Bf16State(HalfPrecisionState):
    """bfloat16: fp32's range, 8 bits of mantissa; runs on gloo too."""

    dtype = torch.bfloat16


class HalfPrecisionReduceScatter(CompressedReduceScatter):
    """The 16-bit cast as FSDP2's gradient reduce-scatter: the op's factor applied in the cast,
    one all-to-all, the received copies summed in fp32."""

    dtype = torch.float16

    def row_bytes(self, n):
        return 2 * n

    def reduce_scatter(self, output, flat, group, world, n, alpha):
        send = ops.scale_cast(flat, alpha, self.dtype)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        torch.sum(recv.view(world, n), dim=0, dtype=torch.float32, out=output.view(n))


class Fp16ReduceScatter(HalfPrecisionReduceScatter):
    dtype = torch.float16


class Bf16ReduceScatter(HalfPrecisionReduceScatter):
    dtype = torch.bfloat16


# native: fp16 and bf16 share the "cast" algorithm (the dtype is the layout's wire buffer's);
# "cast_phases" runs the phase functions above as the stage 2 of scope=inter_node
METHODS = (
    Method("fp16", Fp16State, options=LOSSY, native="cast", native_stage2="cast_phases",
           sharded=Fp16ReduceScatter, sharded_options=("scope",)),
    Method("bf16", Bf16State, options=LOSSY, native="cast", native_stage2="cast_phases",
           sharded=Bf16ReduceScatter, sharded_options=("scope",)),
)

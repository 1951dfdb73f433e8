"""The gradient exchange across replica groups: one descriptor per codec.

Inside a replica group DDP averages the gradients as usual (fast links inside a node); once per
step, after the last backward pass, every rank averages its group's gradients with the same rank
of every other group (torchft's process group, rebuilt at each membership change) through a codec.
Every collective goes through :class:`Across`, which reports a failure to the manager instead of
raising: the step is then not committed (its gradients are dropped) and the survivors go on.

The exchange is per step, over all gradients flattened in parameter order, not per DDP bucket:
buckets are rebuilt after a group's first step, so a group that just joined would cut them
differently from the survivors.

====================  ===================================================  ======================
codec                 what travels                                         bytes per element
====================  ===================================================  ======================
``allreduce``         fp32 allreduce of the average                        4
``fp16``, ``bf16``    16-bit allreduce, divided by the groups before       2
``int8``              blockwise int8 all-to-all, fp32 sum, int8            ~2 (G-1)/G x (1 + 4/block)
                      all-gather; error feedback on both sides
====================  ===================================================  ======================

Not here (refused under ``elastic.recovery: live``): ``onebit`` and ``onebit_adam`` (their
server-side memory belongs to a fixed set of ranks), ``powersgd`` (its warm start and error memory
assume the same peers every step).
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Callable, Optional

import torch
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions, ReduceOp

from .. import ops


class Across:
    """Fault-tracked collectives over the replica groups of the current quorum (``groups`` of
    them, this one ``rank``-th). A failed one reports the error to the manager (the step is
    dropped) and returns False; after a failure the rest of the step's collectives are skipped."""

    def __init__(self, manager, timeout: timedelta):
        self.manager = manager
        self.timeout = timeout

    @property
    def groups(self) -> int:
        return self.manager.num_participants()

    @property
    def rank(self) -> int:
        return self.manager.participating_rank() or 0

    def _run(self, start: Callable) -> bool:
        if self.manager.errored():
            return False
        try:
            start().wait(self.timeout)
            return True
        except Exception as exc:  # a group died or left: the manager drops the step
            self.manager.report_error(exc)
            return False

    def sum(self, tensor: torch.Tensor) -> bool:
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        return self._run(lambda: self.manager._pg.allreduce([tensor], opts))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> bool:
        return self._run(lambda: self.manager._pg.alltoall_base(output, input, [], [], AllToAllOptions()))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> bool:
        rows = list(output.view(self.groups, -1).unbind(0))
        return self._run(lambda: self.manager._pg.allgather([rows], [input], AllgatherOptions()))


class Codec:
    """How one flat fp32 gradient vector is averaged over the groups (:meth:`average`), with the
    memory it keeps (error feedback) in :meth:`state_dict` so a group that heals gets it too."""

    name = "allreduce"
    bytes_per_element = 4.0

    def __init__(self, options: dict):
        self.options = dict(options)
        self.counters = [0, 0, 0]  # fp32 bytes handed over, bytes sent (ring model), steps

    def exchange(self, flat: torch.Tensor, across: Across) -> bool:
        """Average ``flat`` over the groups, counting the traffic; False: a collective failed."""
        groups = across.groups
        if groups > 1:
            ring = 2.0 * (groups - 1) / groups
            self.counters[0] += 4 * flat.numel()
            self.counters[1] += int(ring * self.bytes_per_element * flat.numel())
            self.counters[2] += 1
        return self.average(flat, across) if groups > 1 else not across.manager.errored()

    def average(self, flat: torch.Tensor, across: Across) -> bool:
        flat.div_(across.groups)
        return across.sum(flat)

    def stats(self) -> dict:
        """As a comm hook's (the step and epoch lines' ``comm`` part): across the replica groups."""
        raw, wire, steps = self.counters
        return {"name": self.name, "raw_bytes": raw, "wire_bytes": wire, "steps": steps, "buckets": steps,
                "fp32_wire_bytes": int(wire * 4.0 / self.bytes_per_element), "compression": raw / wire if wire else None}

    def state_dict(self) -> dict:
        return {"counters": list(self.counters)}

    def load_state_dict(self, state: dict) -> None:
        self.counters = list(state.get("counters", self.counters))

    def pair(self, optimizer) -> None:
        """The run's optimizer is known (an Adam-family one picks int8's smaller blocks)."""


class HalfPrecision(Codec):
    name, dtype, bytes_per_element = "fp16", torch.float16, 2.0

    def average(self, flat, across):
        wire = ops.scale_cast(flat, 1.0 / across.groups, self.dtype)  # the sum cannot overflow where the mean would not
        if not across.sum(wire):
            return False
        ops.cast_scale_copy_(flat, wire, 1.0)
        return True


class BFloat16(HalfPrecision):
    name, dtype = "bf16", torch.bfloat16


class Int8(Codec):
    """Two phases as the ``int8`` comm hook (ddpx/comm_hooks/int8.py): each group quantizes the chunk
    every group owns, one all-to-all; the owner sums its chunk in fp32, requantizes, one all-gather.
    The worker error is kept per gradient element; the server error per owned chunk is reset when the
    groups change (its chunk is another)."""

    name = "int8"

    def __init__(self, options: dict):
        super().__init__(options)
        self.block = options.get("block_size", "auto")
        self.worker_error: Optional[torch.Tensor] = None
        self.server_error: Optional[torch.Tensor] = None
        self.server_layout = None  # (groups, rank, chunk) the server error belongs to

    @property
    def block_size(self) -> int:
        """Elements per scale: the option, or 64 while ``auto`` is not paired yet (an unpaired run)."""
        return self.block if isinstance(self.block, int) else 64

    @property
    def bytes_per_element(self) -> float:
        return 1.0 + 4.0 / self.block_size

    def pair(self, optimizer) -> None:
        if self.block == "auto":  # Adam divides by its second moment: small blocks (docs/comm_hooks.md)
            self.block = 64 if "betas" in getattr(optimizer, "defaults", {}) else 256

    def average(self, flat, across):
        groups, rank, block = across.groups, across.rank, self.block_size
        n = flat.numel()
        chunk = ops.ceil_div(ops.ceil_div(n, groups), block) * block
        blocks = chunk // block
        padded = torch.zeros(groups * chunk, dtype=torch.float32, device=flat.device)
        padded[:n] = flat
        if self.worker_error is None or self.worker_error.numel() < groups * chunk:
            grown = torch.zeros(groups * chunk, dtype=torch.float32, device=flat.device)
            if self.worker_error is not None:
                grown[:self.worker_error.numel()] = self.worker_error
            self.worker_error = grown
        if self.server_layout != (groups, rank, chunk):
            self.server_error = torch.zeros(chunk, dtype=torch.float32, device=flat.device)
            self.server_layout = (groups, rank, chunk)
        row = 4 * blocks + chunk
        send = torch.empty(groups * row, dtype=torch.uint8, device=flat.device)
        recv = torch.empty_like(send)
        scales, q = _rows(send, groups, blocks)
        error = self.worker_error[:groups * chunk]
        for r in range(groups):
            ops.int8_quantize(padded.narrow(0, r * chunk, chunk), block, error.narrow(0, r * chunk, chunk),
                              out_q=q[r], out_scales=scales[r])
        if not across.all_to_all(recv, send):
            return False
        scales, q = _rows(recv, groups, blocks)
        reduced = torch.empty(chunk, dtype=torch.float32, device=flat.device)
        ops.int8_dequant_accumulate_(reduced, q, scales, block, 1.0 / groups)
        mine = torch.empty(row, dtype=torch.uint8, device=flat.device)
        scales1, q1 = _rows(mine, 1, blocks)
        ops.int8_quantize(reduced, block, self.server_error, out_q=q1[0], out_scales=scales1[0])
        gathered = torch.empty(groups * row, dtype=torch.uint8, device=flat.device)
        if not across.all_gather(gathered, mine):
            return False
        scales, q = _rows(gathered, groups, blocks)
        for r in range(groups):
            ops.int8_dequant_accumulate_(padded.narrow(0, r * chunk, chunk), q[r], scales[r], block)
        flat.copy_(padded[:n])
        return True

    def state_dict(self) -> dict:
        return dict(super().state_dict(), block_size=self.block, worker_error=self.worker_error)

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.block = state.get("block_size", self.block)
        error = state.get("worker_error")
        self.worker_error = None if error is None else error.clone()
        self.server_error, self.server_layout = None, None


def _rows(buffer: torch.Tensor, groups: int, blocks: int):
    """(scales fp32 [G, blocks], q int8 [G, chunk]) views of a [G * row] byte buffer."""
    rows = buffer.view(groups, -1)
    return rows[:, :4 * blocks].view(torch.float32), rows[:, 4 * blocks:].view(torch.int8)


@dataclasses.dataclass(frozen=True)
class CodecSpec:
    cls: type
    options: tuple  # the comm_hook.options it takes


CODECS = {"allreduce": CodecSpec(Codec, ()), "fp16": CodecSpec(HalfPrecision, ()),
          "bf16": CodecSpec(BFloat16, ()), "int8": CodecSpec(Int8, ("block_size",))}

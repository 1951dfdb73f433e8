"""ddpx's compression as FSDP2's gradient reduce-scatter (``trainer.strategy: fsdp``).

FSDP2 reduce-scatters each unit's gradients once per step: the input is the unit's
flat padded gradient, rank r's part of the result is ``input[r*n:(r+1)*n]`` summed
over the ranks (``n = output.numel()``). ``FSDPModule.set_custom_reduce_scatter``
lets ddpx do that step with its kernels instead, as phase 1 of the int8 DDP hook
(ddpx/comm_hooks/int8.py):

The methods that have one name it in their descriptor (``Method.sharded``:
``Int8ReduceScatter`` in ddpx/comm_hooks/int8.py, the 16-bit ones in halfprec.py);
``Method.make_sharded`` (or :func:`make` by name) makes it, :func:`install` puts it on
every FSDP unit.

* each rank codes its input chunk by destination (``int8``: blockwise int8 with one
  fp32 scale per ``block_size`` elements, ``ddpx.ops.int8_quantize``; ``fp16`` /
  ``bf16``: the op's factor applied in the cast, ``ddpx.ops.scale_cast``, so an
  average cannot overflow fp16 where the mean itself would not);
* ONE ``all_to_all_single`` sends chunk r to rank r (int8: codes and scales in one
  byte buffer per destination, ``[scales fp32 | q int8 | padding to 4 bytes]``);
* rank r sums the R copies it received in fp32 into the output
  (``ddpx.ops.int8_dequant_accumulate_``; the 16-bit ones with ``torch.sum`` in fp32),
  so unlike ``fsdp.reduce_dtype=bf16`` nothing is summed in 16 bits.

Wire per rank and call: (R-1) rows of ``n * 4`` bytes for fp32's reduce-scatter,
``(R-1) * (n + 4 * ceil(n / block_size))`` (+ at most 3 bytes of padding) for int8,
``(R-1) * 2n`` for fp16 / bf16 (``call_bytes``). A non-finite gradient stays
non-finite: an int8 block holding NaN/Inf gets a NaN scale, a 16-bit cast keeps
Inf and NaN, so GradScaler and the non-finite guard see it.

``scope: inter_node`` (``auto``; ddpx/comm_hooks/scope.py finds the nodes): an exact fp32
reduce-scatter inside each node, then the coded one across nodes (:class:`_NodePlan`).

No error feedback: a worker's residual would be a full unsharded fp32 gradient of
every unit kept per rank, the memory fsdp shards away (docs/sharded.md#compression).
The whole flat gradient is coded (no exempt parameters: the layout of the flat
buffer is FSDP's); the per-block scale bounds each block's error by its own largest value.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..errors import DdpxError
from .comm_state import CommState

_ReduceOp = dist.ReduceOp
_UNRESOLVED = object()


def _factor(op, world: int):
    """The factor the op multiplies the sum by: ``1/world`` for AVG, 1 for SUM, ``f`` for
    ``PREMUL_SUM(f)`` (a float or a tensor); anything else FSDP never reduces with."""
    kind = getattr(op, "op", op)  # PREMUL_SUM(f) is a ReduceOp object; AVG and SUM its RedOpType
    if kind == _ReduceOp.AVG:
        return 1.0 / world
    if kind == _ReduceOp.SUM:
        return 1.0
    if kind == _ReduceOp.PREMUL_SUM:
        return op.factor
    raise DdpxError(f"ddpx's compressed reduce-scatter sums gradients (AVG, SUM, PREMUL_SUM), not {op}")


def _split(factor):
    """(alpha applied in the kernel as a float, tensor applied to the output after or None):
    a tensor factor is never read back to the host."""
    return (1.0, factor) if torch.is_tensor(factor) else (float(factor), None)


class CompressedReduceScatter(CommState):
    """A method's sharded form: a :class:`CommState` with FSDP2's ``ReduceScatter`` interface
    (:func:`install` hands each unit a thin subclass of torch's that calls it). One object
    serves every FSDP unit of a model (it holds no per-unit state), and counts what this rank
    sends: :meth:`stats`. Subclasses implement ``row_bytes`` and ``reduce_scatter``."""

    def __init__(self, method, **opts):
        super().__init__(method, opts, sharded=True)
        self.raw_bytes = 0  # fp32 gradient bytes handed over (every rank's chunks)
        self.wire_bytes = 0  # bytes this rank sent to the others
        self.fp32_wire_bytes = 0  # what fp32's reduce-scatter would have sent
        self.calls = 0
        self.unit_calls: list[int] = []  # per unit installed (install): one call per step each
        self._plan = _UNRESOLVED  # the scope's plan: None (global) or a _NodePlan

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if async_op:
            raise ValueError(f"comm hook {self.name!r} under fsdp runs its reduce-scatter synchronously "
                             "(async_op=False, as FSDP2 calls it)")
        for what, t in (("input", input_tensor), ("output", output_tensor)):
            if t.dtype != torch.float32:
                raise DdpxError(f"comm hook {self.name!r} under trainer.strategy=fsdp codes fp32 gradients, its "
                                f"{what} is {t.dtype}: set fsdp.reduce_dtype=fp32")
        world = dist.get_world_size(group)
        n = output_tensor.numel()
        if input_tensor.numel() != world * n:
            raise ValueError(f"reduce-scatter input has {input_tensor.numel()} elements, not {world} x {n}")
        alpha, post = _split(_factor(op, world))
        self.auto_options.use()  # an auto option never paired: fixed here, said once
        plan = self.plan(group)
        if plan is None:
            self.reduce_scatter(output_tensor, input_tensor.view(-1), group, world, n, alpha)
            self.wire_bytes += self.call_bytes(n, world)
        else:
            self.wire_bytes += plan.run(self, output_tensor, input_tensor.view(-1), n, alpha)
        if post is not None:
            output_tensor.mul_(post.to(output_tensor.device, output_tensor.dtype))
        self.raw_bytes += 4 * input_tensor.numel()
        self.fp32_wire_bytes += (world - 1) * 4 * n
        self.calls += 1
        return None

    def plan(self, group):
        """The ``scope`` option on FSDP's ``group`` (ddpx's 1-D mesh: every rank): None (global)
        or a :class:`_NodePlan`. A collective the first time (ddpx/comm_hooks/scope.py finds
        the nodes), which :func:`install` runs, on every rank alike."""
        if self._plan is _UNRESOLVED:
            self._plan = _NodePlan.resolve(self, group)
        return self._plan

    def call_bytes(self, n: int, world: int) -> int:
        """Bytes this rank sends in one reduce-scatter with chunks of ``n`` elements over
        ``world`` ranks: a coded chunk to each other rank (its own stays home)."""
        return (world - 1) * self.row_bytes(n)

    def row_bytes(self, n: int) -> int:
        """Bytes of one destination's coded chunk of ``n`` elements."""
        raise NotImplementedError

    def reduce_scatter(self, output, flat, group, world: int, n: int, alpha: float) -> None:
        raise NotImplementedError

    def stats(self) -> dict:
        """Totals since creation, as a DDP hook's ``stats()``: ``raw_bytes`` (fp32 gradient bytes
        reduce-scattered), ``wire_bytes`` (bytes this rank sent), ``fp32_wire_bytes`` (what
        fp32's reduce-scatter sends), ``calls`` (reduce-scatters), ``steps`` (backward passes
        that reduce-scattered: the calls of the unit called most, each unit being called once a
        step; the calls when not installed), ``compression`` (fp32 wire / wire)."""
        return {"name": self.name, "raw_bytes": self.raw_bytes, "wire_bytes": self.wire_bytes,
                "fp32_wire_bytes": self.fp32_wire_bytes, "calls": self.calls,
                "steps": max(self.unit_calls) if self.unit_calls else self.calls,
                "compression": (self.fp32_wire_bytes / self.wire_bytes) if self.wire_bytes else None}

    def __repr__(self):
        opts = ", ".join(f"{k}={v!r}" for k, v in self.opts.items())
        return f"ddpx.comm_hooks.reduce_scatter.make({self.name!r}{', ' if opts else ''}{opts})"


def make(name: str, **options) -> CompressedReduceScatter:
    """The reduce-scatter of method ``name`` (``int8``, ``fp16``, ``bf16``) for
    ``FSDPModule.set_custom_reduce_scatter``: ``ddpx.comm_hooks.method(name).make_sharded``."""
    from .registry import method

    return method(name).make_sharded(**options)


class _NodePlan:
    """``scope: inter_node`` on a job of N nodes x L ranks: stage 1 reduce-scatters in fp32
    inside the node (rank (i, j) gets the node's sum of the chunks of local rank j on every
    node), stage 2 is the method's reduce-scatter of those N chunks among the ranks of local
    rank j on every node (``cross_group``). On one node stage 1 is all of it (exact fp32),
    as ``inter_node`` is for the DDP hooks."""

    def __init__(self, topo, group):
        self.topo = topo
        me = dist.get_rank()
        self.local_group = topo.local_group or group  # one node: FSDP's group is the node
        self.cross_group = topo.cross_group
        where = {r: j for members in topo.nodes_members for j, r in enumerate(members)}
        node = next(m for m in topo.nodes_members if me in m)
        # group ranks follow global ranks: the destinations inside the node, and the chunks
        # each one reduces across nodes (the order of its cross group)
        dests = sorted(node)
        self.me = dests.index(me)
        self.order = [c for d in dests for c in sorted(m[where[d]] for m in topo.nodes_members)]

    @classmethod
    def resolve(cls, comm, group):
        scope = comm.opts.get("scope", "global")
        if scope == "global":
            return None
        from .scope import say_once, scoped_topology

        name = f"comm hook {comm.name!r} under fsdp, scope={scope}"
        topo = scoped_topology(scope, name, group, whose="FSDP's")
        if topo is None:
            return None
        if topo.local_world == 1 or (scope == "auto" and topo.nodes == 1):
            if scope == "inter_node":
                say_once("%s: one rank per node: the same as scope=global", name)
            return None
        if topo.nodes == 1:
            say_once("%s: one node (%d ranks): an exact fp32 reduce-scatter, nothing crosses a slow link", name,
                     topo.local_world)
        return cls(topo, group)

    def run(self, comm, output, flat, n: int, alpha: float) -> int:
        """The two stages; returns the bytes this rank sent across nodes (the node-local
        stage is on the fast link and not counted, as for the DDP hooks)."""
        from .scope import reduce_scatter_in_node

        nodes = self.topo.nodes
        rows = torch.cat([flat.narrow(0, c * n, n) for c in self.order])
        reduce_scatter_in_node(rows, torch.empty_like(rows), self.me, self.local_group)
        mine = rows.narrow(0, self.me * nodes * n, nodes * n)
        if nodes == 1:
            torch.mul(mine, alpha, out=output)
            return 0
        comm.reduce_scatter(output, mine, self.cross_group, nodes, n, alpha)
        return comm.call_bytes(n, nodes)


@functools.cache
def _unit_reduce_scatter_class():
    """``comm`` as one FSDP unit's reduce-scatter, counting that unit's calls (``stats()["steps"]``).
    Built on first use: importing FSDP costs every process about 0.8 s of CPU, and only fsdp
    runs need it."""
    try:  # FSDPModule.set_custom_reduce_scatter's interface (torch 2.13 has it; Method.make_sharded checks)
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    except ImportError:  # pragma: no cover - Method.make_sharded refuses on such a torch
        ReduceScatter = object

    class UnitReduceScatter(ReduceScatter):
        def __init__(self, comm: CompressedReduceScatter, index: int):
            self.comm, self.index = comm, index

        def allocate(self, size, *, dtype, device):
            return self.comm.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            self.comm.unit_calls[self.index] += 1
            return self.comm(output_tensor, input_tensor, group, op, async_op)

    return UnitReduceScatter


def install(model: torch.nn.Module, comm: CompressedReduceScatter) -> int:
    """``comm`` as the gradient reduce-scatter of every FSDP unit of ``model``; returns how many."""
    from torch.distributed.fsdp import FSDPModule

    unit_class = _unit_reduce_scatter_class()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            comm.unit_calls.append(0)
            module.set_custom_reduce_scatter(unit_class(comm, len(comm.unit_calls) - 1))
    if comm.unit_calls:
        comm.plan(dist.group.WORLD)  # the scope's collective now, not in the first backward
    return len(comm.unit_calls)

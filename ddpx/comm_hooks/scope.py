"""The ``scope`` option of every lossy hook: where the compressed reduction runs.

``global`` (the default): the hook compresses the whole bucket among all ranks.
``inter_node``: two levels. Links inside a node (NVLink, PCIe, shared memory)
are 10-100x faster than the links between nodes, so only the slow link carries
compressed data::

      node 0: ranks 0 1          node 1: ranks 2 3
    1. reduce-scatter (fp32, exact) inside each node: local rank l holds shard l
       of the node's sum
    2. the hook's compressed reduction of shard l among the ranks with local rank
       l on every node (0 <-> 2, 1 <-> 3): one group per local rank
    3. all-gather inside each node: every local rank's stage-2 result message (the
       codes its hook decodes), which every rank decodes into that rank's shard: the
       bits of an all-gather of the decoded fp32 shards, for fewer bytes

``powersgd`` keeps its matrices whole instead (a matrix's P and Q need all of
it): exact fp32 allreduce inside the node, then PowerSGD on the whole bucket
among the ranks of one local rank across nodes (see ``InterNode``).
``auto``: ``inter_node`` when the job has more than one node and more than one
rank per node, else ``global``.

Nodes come from the launcher's facts, not from hostnames: torchrun's
``GROUP_RANK`` / ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` or SLURM's ``SLURM_NODEID``
/ ``SLURM_LOCALID``, gathered from every rank and checked to be uniform (every
node the same rank count, local ranks 0..L-1). A job that is not falls back to
``global`` with one line saying why; one node only makes ``inter_node`` an exact
allreduce (nothing crosses a slow link), said once.

The stage-2 state (error feedback, warm starts) is an ordinary hook state of
the same method (``InterNode.inner``), made by the user-facing state's ``stage2``
(ddpx/comm_hooks/state.py, ``LossyState``): its memory dict *is* the user-facing
state's, so ``state_dict()`` / ``load_state_dict()`` keep it per rank as for
``global``. The plan talks to the states through that interface only
(``keep_matrices_whole``, ``coding_unit``, ``stage2``, ``assign_key``, ``key_of``,
``compressible``, the layouts and the two-phase functions), never through their
attributes. Stage 2's keys name the set of parameters in the bucket and the node
layout (``shard_key``): a checkpoint resumed on another layout (2 x 2 -> 1 x 2,
2 x 1, ...) finds no memory under its keys and starts it from zero, and so does a
bucket whose parameter set DDP's rebuild changes (a shard mixes parameters, so its
memory cannot follow them one by one; powersgd's is per matrix and does).
"""

from __future__ import annotations

import logging
import os
import zlib

import torch
import torch.distributed as dist

from .. import ops
from .state import BucketLayout, ring_allreduce_bytes
from .twophase import Piece, Pipelined

log = logging.getLogger("ddpx.comm_hooks")

EXACT = "exact"  # a resolved scope: plain fp32 allreduce (inter_node on one node)
_SAID: set[str] = set()


def say_once(msg: str, *args) -> None:
    """Log ``msg % args`` once per process (the scope's fallbacks, said where they happen)."""
    text = msg % args
    if text not in _SAID:
        _SAID.add(text)
        log.warning("%s", text)


def node_facts(env=os.environ):
    """(node, local rank, local world size or None) from the launcher, or None if it told nothing."""
    node = env.get("GROUP_RANK", env.get("NODE_RANK"))  # torchrun's; Ray Train's
    if node is not None and "LOCAL_RANK" in env:
        lws = env.get("LOCAL_WORLD_SIZE")
        return int(node), int(env["LOCAL_RANK"]), int(lws) if lws else None
    if "SLURM_NODEID" in env and "SLURM_LOCALID" in env:  # srun
        per_node = env.get("SLURM_NTASKS_PER_NODE", "")
        return int(env["SLURM_NODEID"]), int(env["SLURM_LOCALID"]), int(per_node) if per_node.isdigit() else None
    return None


class Topology:
    """The job's nodes as the launcher describes them, checked on every rank.

    ``reason`` is None when the layout is uniform: ``nodes`` x ``local_world``
    ranks, this rank is ``local_rank`` on node ``node``; otherwise it says why
    not and the hooks run ``global``. ``local_group`` (this node's ranks) and
    ``cross_group`` (this local rank on every node) exist when both counts are
    above one; ``facts`` are every rank's ``node_facts()``, ``me`` this rank; every rank creates every node's and every local rank's group, in
    the same order."""

    def __init__(self, facts: list, me: int):
        self.reason = None
        self.nodes = self.local_world = 1
        self.node = self.local_rank = 0
        self.local_group = self.cross_group = None
        world = len(facts)
        if any(f is None for f in facts):
            missing = [r for r, f in enumerate(facts) if f is None]
            self.reason = (f"rank(s) {missing[:4]} have no node facts from the launcher (torchrun's GROUP_RANK/"
                           "LOCAL_RANK/LOCAL_WORLD_SIZE, Ray's NODE_RANK/LOCAL_RANK or SLURM_NODEID/SLURM_LOCALID)")
            return
        by_node: dict[int, list[tuple[int, int]]] = {}
        for r, (node, local, _) in enumerate(facts):
            by_node.setdefault(node, []).append((local, r))
        counts = {n: len(v) for n, v in by_node.items()}
        if len(set(counts.values())) != 1:
            self.reason = "nodes have different rank counts (" + ", ".join(
                f"node {n}: {c}" for n, c in sorted(counts.items())) + ")"
            return
        size = next(iter(counts.values()))
        for n, members in by_node.items():
            if sorted(local for local, _ in members) != list(range(size)):
                self.reason = f"node {n}'s local ranks are {sorted(m[0] for m in members)}, not 0..{size - 1}"
                return
        stated = {f[2] for f in facts if f[2] is not None}
        if stated and stated != {size}:
            self.reason = f"LOCAL_WORLD_SIZE says {sorted(stated)}, the ranks per node are {size}"
            return
        self.nodes, self.local_world = len(by_node), size
        self.node_ids = sorted(by_node)
        self.nodes_members = [[r for _, r in sorted(by_node[n])] for n in self.node_ids]  # [node][local] -> rank
        self.node, self.local_rank = next((i, m.index(me)) for i, m in enumerate(self.nodes_members) if me in m)
        assert world == self.nodes * self.local_world

    def make_groups(self, backend) -> None:
        """One group per node, then one per local rank: on every rank, in this order."""
        if self.local_group is not None or self.nodes == 1 or self.local_world == 1:
            return
        for i, members in enumerate(self.nodes_members):
            g = dist.new_group(ranks=members, backend=backend)
            if i == self.node:
                self.local_group = g
        for j in range(self.local_world):
            g = dist.new_group(ranks=[m[j] for m in self.nodes_members], backend=backend)
            if j == self.local_rank:
                self.cross_group = g


_TOPOLOGIES: dict = {}  # the world group -> Topology (groups shared by every hook state of the process)


def topology(group) -> Topology:
    """The job's node layout (a collective on `group`, the world group: call on every rank)."""
    topo = _TOPOLOGIES.get(group)
    if topo is None:
        facts = [None] * dist.get_world_size(group)
        dist.all_gather_object(facts, node_facts(), group=group)
        topo = Topology(facts, dist.get_rank())
        if topo.reason is None:
            topo.make_groups(dist.get_backend(group))
        _TOPOLOGIES.clear()  # an earlier world (destroyed process group) is gone
        _TOPOLOGIES[group] = topo
    return topo


def scoped_topology(scope: str, name: str, group, whose: str = "its"):
    """The nodes of ``group`` for ``scope`` inter_node or auto, or None where the hook must run
    global (said once under ``name``): the group is not the world's, or the nodes are not
    uniform. A collective the first time (see ``topology``)."""
    if dist.get_world_size(group) != dist.get_world_size():
        say_once("%s: runs global: %s process group is not the world group", name, whose)
        return None
    topo = topology(group)
    if topo.reason is not None:
        if scope == "inter_node":
            say_once("%s: runs global: %s", name, topo.reason)
        return None
    return topo


def resolve(state):
    """The plan of `state`'s scope: None (global), EXACT or an :class:`InterNode`.
    A collective the first time (see ``topology``): call at the same point on every rank."""
    scope = state.opts.get("scope", "global")
    if scope == "global":
        return None
    name = f"comm hook {state.name!r} scope={scope}"
    topo = scoped_topology(scope, name, state.process_group)
    if topo is None:
        return None
    if scope == "auto":
        return InterNode(state, topo) if topo.nodes > 1 and topo.local_world > 1 else None
    if topo.nodes == 1:
        say_once("%s: one node (%d ranks): an exact fp32 allreduce, nothing crosses a slow link", name,
                 topo.local_world)
        return EXACT
    if topo.local_world == 1:
        say_once("%s: one rank per node: the same as scope=global", name)
        return None
    return InterNode(state, topo)


# gloo has no real reduce-scatter (torch's reduce_scatter_tensor clones the input and
# allreduces all of it): for 24 MB per rank on 2 ranks it costs 24-27 ms of CPU where this
# costs 7-9 (docs/comm_hooks.md, the step-time measurements of inter_node).
def reduce_scatter_in_node(rows, recv, me: int, local_group) -> None:
    """Row ``me`` of ``rows`` ([L, n] flat, L the ranks of ``local_group``; ``recv`` as large)
    becomes the sum of every local rank's row ``me``: one all-to-all, then the other ranks'
    copies added in local-rank order (on 2 ranks the a + b of an allreduce, bit for bit)."""
    L = dist.get_world_size(local_group)
    n = rows.numel() // L
    dist.all_to_all_single(recv, rows, group=local_group)
    mine = rows.narrow(0, me * n, n)
    for j in range(L):
        if j != me:
            mine.add_(recv.narrow(0, j * n, n))


def shard_key(param_keys, topo) -> int:
    """The stage-2 memory key of a bucket: its parameter set and the node layout (above
    the parameter ordinals, which ``global`` uses)."""
    text = repr((sorted(param_keys), topo.nodes, topo.local_world))
    return (1 << 40) + zlib.crc32(text.encode())


class InterNode(Pipelined):
    """The ``inter_node`` plan of one hook state: layouts and the three stages, pipelined
    as the two-phase hooks are (ddpx/comm_hooks/twophase.py), on the state's executor.

    Stage 2 is ``inner``, a state of the hook's own class on ``cross_group``, run
    through its phase functions on the node's shard of each bucket (``fp16``/``bf16``:
    one allreduce; the others: their two collectives). Exempt values (small and 1-D
    parameters) travel exactly: reduce-scatter in the node, an fp32 allreduce of the
    shard across nodes, all-gather.

    PowerSGD (``keep_whole``) reduces inside the node with an exact allreduce and runs
    on the whole bucket across nodes: a rank-r approximation is of a whole matrix, and
    cutting matrices into shards would approximate each slice separately (the shards'
    P and Q would not be the matrix's, and rank r per slice multiplies the wire). Every
    local rank of a node then computes the same P and Q for the same matrices, which
    is what ``global`` computes on every rank too, and the cross-node ring has N ranks
    instead of N x L. Assigning matrices to local ranks would send 1/L of it across
    nodes but needs a reduce and a broadcast per matrix in the node and balanced matrix
    sizes; P and Q are already tiny (r (n + m) per matrix).
    """

    def __init__(self, state, topo: Topology):
        super().__init__()
        self.state, self.topo = state, topo
        self.local_group, self.cross_group = topo.local_group, topo.cross_group
        self.keep_whole = state.keep_matrices_whole
        self.inner = state.stage2(topo.cross_group)
        # the C++ algorithm of stage 2 (inter_node.cpp runs it on `inner`)
        self.inner_kind = state.method.native_stage2 or state.method.native
        self.layouts: dict[int, BucketLayout] = {}

    # ------------------------------------------------------------------ layouts
    def layout(self, index: int, params: list[torch.Tensor]) -> BucketLayout:
        lay = self.layouts.get(index)
        if lay is None or not lay.matches(params):
            st = self.state
            lay = BucketLayout(index, params, [st.key_of(p) for p in params], [st.compressible(p) for p in params])
            self._build(lay)
            self.layouts[index] = lay
        return lay

    def _build(self, lay: BucketLayout) -> None:
        """The bucket's shard buffers and the stage-2 layout (whose pieces are the bucket's)."""
        L, dev = self.topo.local_world, lay.params[0].device
        lay.whole = int(self.keep_whole)
        lay.plain_work = None
        if self.keep_whole:
            lay.inner = self.inner.layout(lay.index, lay.params)
            lay.shard_comp = lay.shard_plain = None
        else:
            f32 = dict(dtype=torch.float32, device=dev)
            unit = self.state.coding_unit  # shards are whole blocks (chunks) of stage 2's code
            sc = ops.ceil_div(ops.ceil_div(lay.n_comp, L), unit) * unit
            sp = ops.ceil_div(lay.n_plain, L)
            me = self.topo.local_rank
            # [shard 0 | shard 1 | ...] of the node's compressed values (+ zero padding): stage 1
            # reads it, stage 2 reduces this rank's shard in place, stage 3 broadcasts the shards
            lay.comp = torch.zeros(L * sc, **f32)
            lay.comp_in = torch.zeros(L * sc, **f32)  # stage 1: every local rank's copy of our shard
            lay.plain = torch.zeros(L * sp, **f32)
            lay.plain_in = torch.zeros(L * sp, **f32)
            lay.shard_comp = lay.comp.narrow(0, me * sc, sc)  # stage 2's bucket: one tensor, compressed
            lay.shard_plain = lay.plain.narrow(0, me * sp, sp)
            lay.inner = None  # nothing to compress: stages 1 and 3 and the exempt values' allreduce
            if lay.n_comp:
                self.inner.assign_key(lay.shard_comp, shard_key(lay.keys, self.topo))
                lay.inner = self.inner.layout(lay.index, [lay.shard_comp])
                for pc in lay.inner.pieces:  # what stage 3 shares inside the node (see _share)
                    pc.result = self.inner.result_message(lay.inner, pc)
                    pc.own_result = torch.empty_like(pc.result)
        lay.pieces = lay.inner.pieces if lay.inner is not None else [Piece(0, 1)]

    def wire_bytes(self, lay) -> int:
        """Bytes this rank sends across nodes per step for the bucket (the node-local
        stages are not counted: they are on the fast link)."""
        cross = self.inner.wire_bytes(lay.inner) if lay.inner is not None else 0
        if not self.keep_whole:
            cross += ring_allreduce_bytes(4 * lay.shard_plain.numel(), self.topo.nodes)
        return cross

    # ------------------------------------------------------------------- stages
    def run_bucket(self, bucket) -> torch.futures.Future:
        st = self.state
        buf = bucket.buffer()
        lay = self.layout(bucket.index(), bucket.parameters())
        last = bucket.is_last()
        st.count(buf.numel(), self.wire_bytes(lay), last)
        return st.executor().submit_deferred(lambda fut: self._pipeline(buf, lay, last, fut), buf.device)

    def _stage_in(self, buf, lay) -> None:
        """Stage 1, inside the node, exact: the node's sum of this rank's shard (or of the
        whole bucket for powersgd), pre-scaled so that stage 2's average is the world's."""
        L, world = self.topo.local_world, self.topo.nodes * self.topo.local_world
        if lay.whole:
            buf.mul_(1.0 / L)
            dist.all_reduce(buf, group=self.local_group)
            return
        if lay.n_comp:
            ops.flatten(lay.runs(buf, True), 1.0 / L, out=lay.comp.narrow(0, 0, lay.n_comp))
            lay.comp.narrow(0, lay.n_comp, lay.comp.numel() - lay.n_comp).zero_()  # the last stage 3 wrote there
            self._reduce_scatter(lay.comp, lay.comp_in)
        if lay.n_plain:  # exempt values: the world's sum, exactly, across nodes too
            ops.flatten(lay.runs(buf, False), 1.0 / world, out=lay.plain.narrow(0, 0, lay.n_plain))
            self._reduce_scatter(lay.plain, lay.plain_in)
            lay.plain_work = dist.all_reduce(lay.shard_plain, group=self.cross_group, async_op=True)

    def _stage_out(self, buf, lay) -> None:
        """Stage 3, inside the node, exact: every shard into the bucket."""
        if lay.whole:
            return
        if lay.n_comp:  # every shard is in comp already (_share, piece by piece)
            ops.unflatten_(lay.comp.narrow(0, 0, lay.n_comp), lay.runs(buf, True))
        if lay.n_plain:
            work, lay.plain_work = lay.plain_work, None
            work.wait()
            self._all_gather(lay.plain)
            ops.unflatten_(lay.plain.narrow(0, 0, lay.n_plain), lay.runs(buf, False))

    def _reduce_scatter(self, rows, recv) -> None:
        reduce_scatter_in_node(rows, recv, self.topo.local_rank, self.local_group)

    def _share(self, lay, pc) -> None:
        """Stage 3 of the piece's compressed values: each local rank's stage-2 result
        message (the codes its ``finish`` decodes: a quarter of fp32 for int8, a half
        for fp16/bf16, about a 26th for onebit) is broadcast inside the node and every
        rank decodes it into that rank's shard of ``comp``, as the owner did: the bits of
        an all-gather of the decoded fp32 shards, for less loopback traffic, and piece
        by piece instead of after the bucket's last piece."""
        me, L = self.topo.local_rank, self.topo.local_world
        n = lay.comp.numel() // L
        pc.own_result.copy_(pc.result)  # the broadcasts before ours land in pc.result
        for j in range(L):  # finish decodes pc.result: one broadcast at a time
            work = dist.broadcast(pc.own_result if j == me else pc.result, group=self.local_group, group_src=j,
                                  async_op=True)
            work.wait()
            if j != me:
                self.inner.finish(lay.comp.narrow(0, j * n, n), lay.inner, pc, work)

    # gloo's all-gather gathers into a new tensor and copies out: for 24 MB per rank on 2
    # ranks 9-10 ms of CPU where this costs 4-6.
    def _all_gather(self, rows) -> None:
        """Every local rank's row l of ``rows`` to every rank, in place: one broadcast per row."""
        L = self.topo.local_world
        n = rows.numel() // L
        works = [dist.broadcast(rows.narrow(0, j * n, n), group=self.local_group, group_src=j, async_op=True)
                 for j in range(L)]
        for w in works:
            w.wait()

    def _shard(self, buf, lay):
        return buf if lay.whole else lay.shard_comp

    # A bucket with nothing to compress (lay.inner None) still runs through the pipeline,
    # whose last bucket drains it; its collective is the exempt values' allreduce.
    def start_phase1(self, buf, lay, pc):
        if pc.first:
            self._stage_in(buf, lay)
        if lay.inner is None:
            return lay.plain_work
        return self.inner.start_phase1(self._shard(buf, lay), lay.inner, pc)

    def start_phase2(self, buf, lay, pc, first):
        if lay.inner is None:
            return first
        return self.inner.start_phase2(self._shard(buf, lay), lay.inner, pc, first)

    def finish(self, buf, lay, pc, second):
        if lay.inner is not None:
            self.inner.finish(self._shard(buf, lay), lay.inner, pc, second)
            if not lay.whole:
                self._share(lay, pc)
        if pc.last:
            self._stage_out(buf, lay)

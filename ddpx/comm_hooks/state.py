"""The state every ddpx DDP comm hook shares.

A hook is a ``HookState`` subclass, named by its method's descriptor
(ddpx/comm_hooks/registry.py, which also holds its options): it builds one
``BucketLayout`` per DDP bucket (which parameter slices are compressed, which
travel uncompressed, the preallocated wire buffers) and runs one bucket in
``run_bucket``. The native C++ hook (csrc/comm_hooks/) runs the same algorithm on
the same layout objects and tensors, so both paths give identical results and
``state_dict()`` sees the same memory.

Keys. Error-feedback memory is kept per parameter, keyed by the parameter's
ordinal in the order the hook first sees parameters (bucket by bucket, in
DDP's initial bucket order, which is deterministic for a given model and
``bucket_cap_mb``). DDP rebuilds its buckets after the first iteration; the
new layout adopts each parameter's memory, so nothing is lost or mixed.

Collective order. Multi-phase hooks issue their collectives on the state's
FIFO executor (``state.executor()``, on ``state.executor_group``); see
ddpx/comm_hooks/executor.py for why.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch
import torch.distributed as dist

from ..errors import DdpxError
from .comm_state import CommState
from .executor import SerialExecutor

log = logging.getLogger("ddpx.comm_hooks")

STATE_DICT_VERSION = 1


def profiled(name: str):
    """A named range (``record_function``) for torch.profiler: the comm-hook phases
    ``ddpx::encode``, ``ddpx::collective``, ``ddpx::decode``, named the same in the
    native hook. Nothing but a flag test when no profiler runs."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.autograd.profiler.record_function(name)
    return contextlib.nullcontext()


def ring_allreduce_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends in a ring allreduce of `nbytes` (reduce-scatter + allgather)."""
    return 2 * (world - 1) * nbytes // world


def merge_runs(items):
    """[(bucket_offset, numel, packed_offset, flag)] in bucket order -> {flag: runs}
    where consecutive items of one flag that are contiguous both in the bucket
    and in the packed buffer merge into one (bucket_offset, numel, packed_offset)."""
    runs: dict[bool, list[list[int]]] = {True: [], False: []}
    last = None  # (flag, bucket end, packed end)
    for off, n, poff, flag in items:
        if n == 0:
            continue
        if last == (flag, off, poff):
            runs[flag][-1][1] += n
        else:
            runs[flag].append([off, n, poff])
        last = (flag, off + n, poff + n)
    return {k: [tuple(r) for r in v] for k, v in runs.items()}


class BucketLayout:
    """What a hook needs to know about one DDP bucket, built once per bucket layout.

    Attributes shared by every hook (read by the native path by name):
        index: DDP bucket index;  numel: bucket elements
        params: the bucket's parameters (identity = the layout's signature)
        keys: the parameters' memory keys
        comp_runs / plain_runs: [(bucket_offset, numel, packed_offset)] runs of
            parameters that are compressed / sent uncompressed, in packed order
            (the packed buffers hold the parameters in key order)
        n_comp / n_plain: elements in each class
    Subclasses' ``build_layout`` add their buffers as attributes.
    """

    def __init__(self, index: int, params: list[torch.Tensor], keys: list[int], compressed: list[bool]):
        self.index = index
        self.params = list(params)
        self.keys = list(keys)
        self.numel = sum(p.numel() for p in params)
        # Packed buffers hold parameters in key order, not DDP's bucket order: DDP
        # reorders a bucket when it rebuilds, and a canonical order keeps the
        # compressed stream (chunks, blocks, error memory) the same for the same
        # set of parameters, e.g. when a run resumes from a checkpoint.
        self.param_packed_offset: list[int | None] = [None] * len(params)
        packed_pos = [0] * len(params)
        packed = {True: 0, False: 0}
        for i in sorted(range(len(params)), key=lambda i: self.keys[i]):
            packed_pos[i] = packed[compressed[i]]
            packed[compressed[i]] += params[i].numel()
            if compressed[i]:
                self.param_packed_offset[i] = packed_pos[i]
        items, off = [], 0
        for i, p in enumerate(params):
            items.append((off, p.numel(), packed_pos[i], compressed[i]))
            off += p.numel()
        runs = merge_runs(items)
        # in packed order, so flatten/unflatten of the run views fill the packed buffer
        self.comp_runs, self.plain_runs = sorted(runs[True], key=lambda r: r[2]), sorted(runs[False], key=lambda r: r[2])
        self.n_comp = sum(n for _, n, _ in self.comp_runs)
        self.n_plain = sum(n for _, n, _ in self.plain_runs)

    def matches(self, params) -> bool:
        return len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params))

    def runs(self, buf: torch.Tensor, compressed: bool) -> list[torch.Tensor]:
        """The bucket slices of one class, as contiguous 1-D views."""
        return [buf.narrow(0, off, n) for off, n, _ in (self.comp_runs if compressed else self.plain_runs)]


class HookState(CommState):
    """Base of every ddpx comm-hook state (one per DDP model): a :class:`CommState`.

    ``Method.make_state`` (``ddpx.comm_hooks.make``) returns it with ``hook``:
    ``hook(state, bucket)`` is the function DDP calls per bucket. Subclasses implement
    ``run_bucket`` (and ``build_layout`` if they need buffers).
    """

    lossy = False
    # per-parameter memory names kept in state_dict (e.g. error feedback)
    memories: tuple[str, ...] = ()
    # collectives depend on earlier results: run on the executor, on executor_group
    multi_phase = False

    def __init__(self, method, process_group=None, **opts):
        super().__init__(method, opts)
        self._group = process_group
        self._world = None
        self._rank = None
        # [raw_bytes, wire_bytes, steps, buckets]: one tensor shared with the native hook
        self.counters = torch.zeros(4, dtype=torch.int64)
        self.layouts: dict[int, BucketLayout] = {}
        self._keys: dict[int, int] = {}  # id(param) -> key
        self._key_params: list[torch.Tensor] = []  # keeps ids valid
        # memory[name][key] = flat tensor (a live view into a layout buffer, or
        # a loaded tensor waiting for its parameter's layout)
        self.memory: dict[str, dict[int, torch.Tensor]] = {m: {} for m in self.memories}
        self._executor: SerialExecutor | None = None
        self._executor_group = None
        self.native = False  # set by ddpx.comm_hooks.register when the C++ hook runs it
        self._native_close: Callable[[], None] | None = None  # ends the native hook's executor (register sets it)
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ group
    @property
    def process_group(self):
        if self._group is None:
            if not dist.is_initialized():
                raise DdpxError("ddpx comm hook used before torch.distributed.init_process_group(); initialise it first")
            self._group = dist.group.WORLD
        return self._group

    @property
    def world_size(self) -> int:
        if self._world is None:
            self._world = dist.get_world_size(self.process_group)
            self._rank = dist.get_rank(self.process_group)
        return self._world

    @property
    def rank(self) -> int:
        self.world_size
        return self._rank

    # ---------------------------------------------------------------- layouts
    def compressible(self, p: torch.Tensor) -> bool:
        """Whether a parameter's gradient goes through the lossy format."""
        return False

    def key_of(self, p: torch.Tensor) -> int:
        k = self._keys.get(id(p))
        if k is None:
            k = len(self._key_params)
            self._keys[id(p)] = k
            self._key_params.append(p)
        return k

    def assign_key(self, tensor: torch.Tensor, key: int) -> None:
        """Make ``key`` the memory key of ``tensor`` (scope inter_node's shard of a bucket,
        whose key names the bucket's parameters: ddpx/comm_hooks/scope.py)."""
        self._keys[id(tensor)] = key
        self._key_params.append(tensor)

    def layout(self, index: int, params: list[torch.Tensor]) -> BucketLayout:
        """The cached layout of bucket `index`; rebuilt when DDP changes the bucket. The
        first one fixes the ``auto`` options that pairing did not choose."""
        self.auto_options.use()
        lay = self.layouts.get(index)
        if lay is None or not lay.matches(params):
            lay = BucketLayout(index, params, [self.key_of(p) for p in params], [self.compressible(p) for p in params])
            self.build_layout(lay)
            self.layouts[index] = lay
        return lay

    def build_layout(self, lay: BucketLayout) -> None:
        """Allocate the layout's buffers (subclasses); call ``adopt`` for memory views."""

    def adopt(self, name: str, key: int, view: torch.Tensor) -> None:
        """Make `view` the home of parameter `key`'s memory `name`, carrying over
        what the previous layout or a loaded state dict held."""
        old = self.memory[name].get(key)
        if old is not None:
            if old.numel() == view.numel():
                view.copy_(old.reshape(-1))
            else:
                self._warn_once(f"shape-{name}-{key}", "%s: %s memory of parameter %d has %d elements, the "
                                "parameter now %d; starting it from zero", self.name, name, key, old.numel(),
                                view.numel())
                view.zero_()
        else:
            view.zero_()
        self.memory[name][key] = view

    # ------------------------------------------------------------------ hook
    def run_bucket(self, bucket) -> torch.futures.Future:
        raise NotImplementedError

    def count(self, bucket_numel: int, wire_bytes: int, last: bool) -> None:
        c = self.counters
        c[0] += 4 * bucket_numel
        c[1] += wire_bytes
        c[3] += 1
        if last:
            c[2] += 1

    @property
    def steps(self) -> int:
        return int(self.counters[2])

    @property
    def executor_group(self):
        """The private process group of the executor's collectives (same ranks as
        ``process_group``); created on first use, which is the same point on
        every rank (the first compressed bucket, or ``ddpx.comm_hooks.register``)."""
        if self._executor_group is None:
            group = self.process_group
            self._executor_group = dist.new_group(ranks=dist.get_process_group_ranks(group),
                                                  backend=dist.get_backend(group), use_local_synchronization=True)
        return self._executor_group

    def executor(self) -> SerialExecutor:
        """The FIFO executor of multi-phase hooks; call from run_bucket (DDP's thread)."""
        if self._executor is None:
            self._executor = SerialExecutor(f"ddpx-{self.name}-hook", self.executor_group)
        return self._executor

    def close(self) -> None:
        """End this hook's executor thread (the native hook's too) after the jobs in
        flight; the hook must not run again. Garbage collection of the state (and of
        the DDP model, for the native hook) does the same, and an idle executor ends
        by itself once its process group is destroyed."""
        if self._executor is not None:
            self._executor.close()
        if self._native_close is not None:
            self._native_close()

    def stats(self) -> dict:
        """Totals since creation: ``raw_bytes`` (fp32 gradient bytes handed to the
        hook), ``wire_bytes`` (bytes this rank sent, ring model), ``fp32_wire_bytes`` (what
        an fp32 ring allreduce of the same gradients sends), ``steps`` (iterations
        communicated), ``buckets`` (hook calls), ``compression`` (raw / wire)."""
        raw, wire, steps, buckets = (int(v) for v in self.counters)
        world = self.world_size if dist.is_initialized() else self._world
        fp32 = ring_allreduce_bytes(raw, world) if world else None
        return {"name": self.name, "raw_bytes": raw, "wire_bytes": wire, "fp32_wire_bytes": fp32, "steps": steps,
                "buckets": buckets, "compression": (raw / wire) if wire else None}

    # ------------------------------------------------------------ state dict
    def state_dict(self) -> dict:
        """This rank's state: options, step counter and per-parameter memory.

        Error-feedback memory is per rank: save one file per rank (e.g.
        ``hook_state_rank{rank}.pt``) and load each rank its own."""
        return {
            "version": STATE_DICT_VERSION,
            "name": self.name,
            "options": dict(self.opts),
            "world_size": self.world_size if dist.is_initialized() else self._world,
            "rank": self.rank if dist.is_initialized() else self._rank,
            "counters": self.counters.clone(),
            "memory": {m: {k: t.detach().clone() for k, t in d.items()} for m, d in self.memory.items()},
        }

    def load_state_dict(self, sd: dict) -> None:
        """Restore counters and memory. A different hook name or version is an
        error; a different world size or rank keeps the counters and resets the
        memory (with a warning); a parameter whose size changed starts from zero."""
        if not isinstance(sd, dict) or sd.get("version") != STATE_DICT_VERSION:
            raise DdpxError(f"comm hook {self.name!r}: not a ddpx hook state dict (version "
                            f"{sd.get('version') if isinstance(sd, dict) else None}, expected {STATE_DICT_VERSION})")
        if sd.get("name") != self.name:
            raise DdpxError(f"comm hook state dict is for {sd.get('name')!r}, not {self.name!r}; "
                            f"load it into ddpx.comm_hooks.make({sd.get('name')!r})")
        saved = sd["counters"].reshape(-1)[: self.counters.numel()]
        self.counters.zero_()[: saved.numel()].copy_(saved)
        world = self.world_size if dist.is_initialized() else None
        if sd.get("world_size") != world or sd.get("rank") != self.rank_or_none():
            log.warning("%s: state dict was saved by rank %s of %s, this is rank %s of %s: error-feedback memory "
                        "is per rank and is reset (counters kept)", self.name, sd.get("rank"), sd.get("world_size"),
                        self.rank_or_none(), world)
            for d in self.memory.values():
                for t in d.values():
                    t.zero_()
            return
        for name, saved in sd.get("memory", {}).items():
            if name not in self.memory:
                continue
            live = self.memory[name]
            for key, t in saved.items():
                cur = live.get(key)
                if cur is not None and cur.numel() == t.numel():
                    cur.copy_(t.reshape(-1))
                elif cur is not None:
                    self._warn_once(f"shape-{name}-{key}", "%s: saved %s memory of parameter %d has %d elements, "
                                    "the parameter has %d; it starts from zero", self.name, name, key, t.numel(),
                                    cur.numel())
                    cur.zero_()
                else:
                    live[key] = t.clone().reshape(-1)

    def rank_or_none(self):
        return self.rank if dist.is_initialized() else None

    def _warn_once(self, key, msg, *args):
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def __repr__(self):
        opts = ", ".join(f"{k}={v!r}" for k, v in self.opts.items())
        return f"ddpx.comm_hooks.make({self.name!r}{', ' if opts else ''}{opts})"


class LossyState(HookState):
    """Base of the compressing hooks (their options: ``options.LOSSY``): warm-up, exemption
    of small tensors, and the interface ``scope: inter_node`` runs them through
    (ddpx/comm_hooks/scope.py): ``keep_matrices_whole``, ``coding_unit``, ``stage2``, and
    the two-phase functions (ddpx/comm_hooks/twophase.py)."""

    lossy = True
    # scope inter_node: an exact allreduce in the node, then this on the whole bucket across
    # nodes (a low-rank approximation is of a whole matrix), instead of a shard per local rank
    keep_matrices_whole = False

    # What the warm-up does, said at registration (ddpx.comm_hooks._announce_warmup).
    warmup_text = "exact fp32 allreduce for the first {n} steps, compressing from step {n}"

    def compressible(self, p):
        return p.numel() >= self.opts["min_numel"] and (p.dim() > 1 or self.opts["compress_vectors"])

    def warming_up(self) -> bool:
        return self.steps < self.opts["warmup_steps"]

    @property
    def coding_unit(self) -> int:
        """Elements the code works in (int8's blocks, onebit's chunks; else 1): scope
        inter_node cuts a bucket into shards of whole units."""
        return 1

    def stage2(self, group) -> "LossyState":
        """The state of scope inter_node's stage 2 on ``group`` (this local rank on every
        node, which its collectives use directly): this method and these options with scope
        global and no warm-up of its own (this state warms up), compressing all of its shard
        unless it keeps matrices whole. It shares this state's memory (``state_dict`` holds
        it), its ``auto`` values and, keeping matrices whole, its parameter keys."""
        opts = dict(self.opts, scope="global", warmup_steps=0)
        if not self.keep_matrices_whole:  # the shard is one compressed tensor
            opts.update({k: v for k, v in (("min_numel", 0), ("compress_vectors", True)) if k in opts})
        inner = type(self)(self.method, group, **opts)
        inner._executor_group = group
        inner.memory = self.memory
        inner.auto_options = self.auto_options
        if self.keep_matrices_whole:
            inner._keys, inner._key_params = self._keys, self._key_params
        return inner


def hook(state: HookState, bucket) -> torch.futures.Future:
    """The comm-hook function for every ddpx state: ``ddp.register_comm_hook(state, hook)``."""
    return state.run_bucket(bucket)


# DDP checks the annotations at registration; this module's postponed
# (string) annotations would not pass, so set the real objects.
hook.__annotations__ = {"state": HookState, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}

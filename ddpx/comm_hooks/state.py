"""The state every ddpx comm hook shares.

A hook is a ``HookState`` subclass: it declares its options, builds one
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
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import DdpxError
from .executor import SerialExecutor

log = logging.getLogger("ddpx.comm_hooks")

STATE_DICT_VERSION = 1


@dataclass(frozen=True)
class Option:
    """One hook option: type, default, a check returning an error text or None, and a doc line."""

    type: type
    default: Any
    check: Callable[[Any], str | None] | None = None
    doc: str = ""


def validate_options(what: str, options: dict[str, Option], opts: dict) -> dict:
    """``opts`` checked against ``options`` and completed with the defaults; a bad one is a
    :class:`DdpxError` starting with ``what`` (e.g. ``comm hook 'int8'``)."""
    unknown = sorted(set(opts) - set(options))
    if unknown:
        known = ", ".join(sorted(options)) or "none"
        raise DdpxError(f"{what}: unknown option(s) {', '.join(unknown)}; known options: {known}")
    out = {}
    for key, spec in options.items():
        v = opts.get(key, spec.default)
        if spec.type is bool:
            ok = isinstance(v, bool)
        elif spec.type is int:
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif spec.type is float:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            v = float(v) if ok else v
        else:
            ok = isinstance(v, spec.type)
        if not ok:
            raise DdpxError(f"{what}: option {key} must be {spec.type.__name__}, got {v!r} ({type(v).__name__})")
        problem = spec.check(v) if spec.check else None
        if problem:
            raise DdpxError(f"{what}: option {key} {problem}, got {v!r}")
        out[key] = v
    return out


def non_negative(v):
    return None if v >= 0 else "must be >= 0"


def positive_multiple_of(k):
    def check(v):
        return None if v > 0 and v % k == 0 else f"must be a positive multiple of {k}"

    return check


def profiled(name: str):
    """A named range (``record_function``) for torch.profiler: the comm-hook phases
    ``ddpx::encode``, ``ddpx::collective``, ``ddpx::decode``, named the same in the
    native hook. Nothing but a flag test when no profiler runs."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.autograd.profiler.record_function(name)
    return contextlib.nullcontext()


_first_step_callbacks: list = []  # waiting for the next optimizer step (see on_first_optimizer_step)
_first_step_hook = None


def on_first_optimizer_step(callback: Callable[[torch.optim.Optimizer], None]) -> None:
    """Call ``callback(optimizer)`` at the first optimizer step of the process after this
    call. One torch step pre-hook per process, registered at the first call and kept (torch
    iterates its hooks while calling them, so one cannot remove itself): it returns at once
    while nothing waits."""
    global _first_step_hook
    if _first_step_hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        def first_step(optimizer, args, kwargs):
            if _first_step_callbacks:
                waiting = _first_step_callbacks[:]
                del _first_step_callbacks[:]
                for cb in waiting:
                    cb(optimizer)

        _first_step_hook = register_optimizer_step_pre_hook(first_step)
    _first_step_callbacks.append(callback)


def adam_family(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` divides by a second moment as Adam does (it has ``betas``:
    Adam, AdamW, NAdam, RAdam, Adamax, and most third-party Adams)."""
    return "betas" in optimizer.defaults


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


class HookState:
    """Base of every ddpx comm-hook state (one per DDP model).

    ``make(name)`` returns ``(state, hook)`` where ``hook(state, bucket)`` is the
    function DDP calls per bucket. Subclasses set ``name``, ``options`` and
    implement ``run_bucket`` (and ``build_layout`` if they need buffers).
    """

    name = ""
    lossy = False
    options: dict[str, Option] = {}
    # per-parameter memory names kept in state_dict (e.g. error feedback)
    memories: tuple[str, ...] = ()
    # the C++ algorithm that runs this state natively (its DDPX_REGISTER_NATIVE_HOOK kind), or None
    native_kind: str | None = None
    # the optimizer (import path) that averages the gradients for this hook, or None: the hook does
    needs_optimizer: str | None = None
    # collectives depend on earlier results: run on the executor, on executor_group
    multi_phase = False
    # the DDP bucket size this hook works best with (None: DDP's default 25 MB); see ddp_options()
    bucket_cap_mb: float | None = None
    # .grad as views of the buckets: a hook writes its result into the bucket, so
    # DDP's copy of every bucket back into .grad is a pass over the gradients saved
    # (and their memory); see ddp_options()
    gradient_as_bucket_view = True

    def __init__(self, process_group=None, **opts):
        self.opts = self._validate(opts)
        for k, v in self.opts.items():
            setattr(self, k, v)
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

    # ----------------------------------------------------------------- options
    @classmethod
    def _validate(cls, opts):
        return validate_options(f"comm hook {cls.name!r}", cls.options, opts)

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

    def layout(self, index: int, params: list[torch.Tensor]) -> BucketLayout:
        """The cached layout of bucket `index`; rebuilt when DDP changes the bucket."""
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
        hook), ``wire_bytes`` (bytes this rank sent, ring model), ``steps``
        (iterations communicated), ``buckets`` (hook calls), ``compression``
        (raw / wire)."""
        raw, wire, steps, buckets = (int(v) for v in self.counters)
        return {"name": self.name, "raw_bytes": raw, "wire_bytes": wire, "steps": steps, "buckets": buckets,
                "compression": (raw / wire) if wire else None}

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
    """Base of the compressing hooks: warm-up and exemption of small tensors."""

    lossy = True
    options = {
        "warmup_steps": Option(int, 0, non_negative, "iterations of plain fp32 allreduce before compression starts"),
        "min_numel": Option(int, 1024, non_negative, "parameters with fewer elements are sent uncompressed"),
        "compress_vectors": Option(bool, False, None, "compress 1-D parameters (biases, norms) too"),
        "scope": Option(str, "global", lambda v: None if v in ("global", "inter_node", "auto") else
                        "must be global, inter_node or auto", "where the compressed reduction runs "
                        "(ddpx/comm_hooks/scope.py)"),
    }

    # What the warm-up does, said at registration (ddpx.comm_hooks._announce_warmup).
    warmup_text = "exact fp32 allreduce for the first {n} steps, compressing from step {n}"

    def compressible(self, p):
        return p.numel() >= self.min_numel and (p.dim() > 1 or self.compress_vectors)

    def warming_up(self) -> bool:
        return self.steps < self.warmup_steps


def hook(state: HookState, bucket) -> torch.futures.Future:
    """The comm-hook function for every ddpx state: ``ddp.register_comm_hook(state, hook)``."""
    return state.run_bucket(bucket)


# DDP checks the annotations at registration; this module's postponed
# (string) annotations would not pass, so set the real objects.
hook.__annotations__ = {"state": HookState, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}

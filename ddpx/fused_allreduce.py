"""Collectives for tensors outside DDP.

``fused_allreduce`` is Horovod-style tensor fusion: many tensors (metrics,
buffers, parameters for periodic model averaging) are packed into a few flat
buckets with the multi-tensor kernel (``ddpx.ops.flatten``), each bucket is
reduced with one asynchronous collective, and the results are copied back in
place (``ddpx.ops.unflatten_``). 1,000 tensors of 1 KB become one collective
instead of 1,000.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from . import ops

__all__ = ["fused_allreduce", "FusedAllreduceHandle"]

_OPS = ("sum", "avg")


class FusedAllreduceHandle:
    """Result of an asynchronous :func:`fused_allreduce`.

    ``wait()`` blocks until every bucket's collective has finished, copies the
    results back into the tensors (in place) and returns the list of tensors.
    The tensors are written only by ``wait()``: a handle that is never waited
    for leaves them unchanged. Calling ``wait()`` again is a no-op.
    """

    def __init__(self, tensors: list[torch.Tensor], pending: list[tuple[Any, Callable[[], None]]]):
        self._tensors = tensors
        self._pending = pending  # (work or future, finish) per bucket, in issue order

    def is_completed(self) -> bool:
        return all(_done(w) for w, _ in self._pending)

    def wait(self) -> list[torch.Tensor]:
        pending, self._pending = self._pending, []
        with torch.no_grad():
            for work, finish in pending:
                work.wait()
                finish()
        return self._tensors


def _done(work) -> bool:
    return work.done() if isinstance(work, torch.futures.Future) else work.is_completed()


def _group_and_bucket(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of `tensors` in buckets: same dtype and device per bucket, at most
    `bucket_bytes` each (a larger tensor gets a bucket of its own). Groups keep the
    order of their first tensor and tensors keep their order inside a group, so
    the buckets depend only on the list's shapes and dtypes: identical on every
    rank that passes the same structure."""
    groups: dict[tuple[torch.dtype, torch.device], list[list[int]]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for i, t in enumerate(tensors):
        key = (t.dtype, t.device)
        nbytes = t.numel() * t.element_size()
        buckets = groups.setdefault(key, [[]])
        if buckets[-1] and sizes[key] + nbytes > bucket_bytes:
            buckets.append([])
            sizes[key] = 0
        buckets[-1].append(i)
        sizes[key] = sizes.get(key, 0) + nbytes
    return [b for buckets in groups.values() for b in buckets]


def _check_args(tensors, op, bucket_mb) -> None:
    if op not in _OPS:
        raise ValueError(f"fused_allreduce: op must be one of {_OPS}, got {op!r}")
    if not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0):
        raise ValueError(f"fused_allreduce: bucket_mb must be a positive number, got {bucket_mb!r}")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fused_allreduce: tensors[{i}] is a {type(t).__name__}, not a torch.Tensor")
        if t.is_sparse:
            raise TypeError(f"fused_allreduce: tensors[{i}] is sparse; only dense tensors can be fused")
        if op == "avg" and not t.is_floating_point():
            raise TypeError(
                f"fused_allreduce: op='avg' needs floating tensors, tensors[{i}] is {t.dtype}; "
                "use op='sum' for integer tensors"
            )


def fused_allreduce(
    tensors: Sequence[torch.Tensor],
    op: str = "avg",
    bucket_mb: float = 25,
    compression=None,
    process_group=None,
    async_op: bool = True,
):
    """All-reduce many tensors in place with a few fused collectives.

    Args:
        tensors: dense tensors, any shapes, dtypes and devices (mixed is fine:
            they are grouped by dtype and device; order is preserved). Every rank
            must pass tensors of the same shapes, dtypes and order.
        op: ``"sum"`` or ``"avg"``. ``"avg"`` is defined as the sum over ranks of
            ``x * (1 / world_size)``: the scale is fused into the packing copy,
            before the sum (fp32 rounding of that product included), which also
            keeps fp16 sums from overflowing.
        bucket_mb: bucket size in MiB; a larger tensor gets a bucket of its own.
        compression: ``None`` / ``"allreduce"``: exact, any dtype. Any other
            name of ``ddpx.comm_hooks.available()`` (``"fp16"``, ``"bf16"``, ``"int8"``,
            ``"onebit"``, ``"powersgd"``) runs that comm hook's own per-bucket
            code on each fused bucket (float32 tensors only), with the hook's
            defaults: small and 1-D tensors travel uncompressed, and a fresh
            state per call, so error feedback and warm starts start from zero
            every call. For memory across calls (e.g. periodic model averaging
            of the same parameters) pass a state instead:
            ``state, _ = ddpx.comm_hooks.make("int8", min_numel=0)``;
            ``state.pair(None)`` (no optimizer steps with these tensors);
            ``fused_allreduce(params, compression=state)``; memory is keyed by
            tensor identity, so pass the same tensor objects every call (the
            state holds a reference to each tensor it has seen). The hooks average:
            with ``op="sum"`` the average is multiplied by the world size.
        process_group: defaults to the world group.
        async_op: when True (default) returns a :class:`FusedAllreduceHandle`
            whose ``wait()`` finishes the copy-back; when False blocks and returns
            None, like ``torch.distributed.all_reduce``.

    Every collective is issued in bucket order, identical on every rank; an
    empty list issues nothing.
    """
    tensors = list(tensors)
    _check_args(tensors, op, bucket_mb)
    codec = _codec(compression, tensors, op, process_group)
    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    scale = 1.0 / world if op == "avg" else 1.0
    pending = []
    buckets = _group_and_bucket(tensors, int(bucket_mb * 2**20))
    with torch.no_grad():
        for index, idx in enumerate(buckets):
            pending.append(codec(index, [tensors[i] for i in idx], scale, group, index == len(buckets) - 1))
    handle = FusedAllreduceHandle(tensors, pending)
    if async_op:
        return handle
    handle.wait()
    return None


def _writeback(members: list[torch.Tensor]) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """Contiguous destinations for unflatten_ and a function copying them back into
    any non-contiguous originals."""
    dests = [t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format) for t in members]
    strided = [(t, d) for t, d in zip(members, dests) if d is not t]

    def copy_back():
        for t, d in strided:
            t.copy_(d)

    return dests, copy_back


def _plain(index, members, scale, group, last):
    flat = ops.flatten(members, scale)
    work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
    dests, copy_back = _writeback(members)

    def finish():
        ops.unflatten_(flat, dests)
        copy_back()

    return work, finish


class _FusedBucket:
    """The part of DDP's GradBucket the comm hooks read, over one fused buffer."""

    def __init__(self, index: int, buf: torch.Tensor, tensors: list[torch.Tensor], last: bool):
        self._index, self._buf, self._tensors, self._last = index, buf, tensors, last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buf

    def parameters(self) -> list[torch.Tensor]:
        return self._tensors

    def is_last(self) -> bool:
        return self._last


def _hook_codec(state, op):
    """Run a comm hook's own per-bucket code (DDP's path) on each fused bucket. The
    hooks average; op='sum' multiplies the average by the world size on the way back."""

    def codec(index, members, scale, group, last):
        flat = ops.flatten(members)
        fut = state.run_bucket(_FusedBucket(index, flat, members, last))
        dests, copy_back = _writeback(members)

        def finish():
            ops.unflatten_(fut.value(), dests, 1.0 if op == "avg" else float(state.world_size))
            copy_back()

        return fut, finish

    return codec


def _codec(compression, tensors, op, process_group):
    if compression is None or compression == "allreduce":
        return _plain
    from . import comm_hooks
    from .comm_hooks.state import HookState

    if isinstance(compression, HookState):
        state = compression
        if process_group is not None and state.process_group is not process_group:
            raise ValueError("fused_allreduce: the compression state has its own process group; "
                             "create it with ddpx.comm_hooks.make(name, process_group=...) instead of passing both")
    elif isinstance(compression, str) and compression in comm_hooks.available():
        # a fused call is not a training step: no warm-up of plain allreduce
        state = comm_hooks.make_state(compression, process_group, **comm_hooks.without_warmup(compression))
        state.pair(None)  # no optimizer steps with these tensors: the auto options' values without one
    else:
        raise ValueError(f"fused_allreduce: unknown compression {compression!r}; use None or one of "
                         f"{comm_hooks.available()} (or a state from ddpx.comm_hooks.make)")
    for i, t in enumerate(tensors):
        if t.dtype != torch.float32:
            raise TypeError(f"fused_allreduce: compression={state.name!r} needs float32 tensors, "
                            f"tensors[{i}] is {t.dtype}; reduce it in a separate call without compression")
    return _hook_codec(state, op)

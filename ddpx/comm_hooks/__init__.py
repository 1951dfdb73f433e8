"""DDP communication hooks with fused compression kernels.

Plain DDP script::

    state, hook = ddpx.comm_hooks.make("int8")          # or "fp16", "bf16", "allreduce"
    ddp_model.register_comm_hook(state, hook)

or, with the native C++ hook (no Python and no GIL per bucket)::

    state = ddpx.comm_hooks.register(ddp_model, "int8", warmup_steps=10)

Both give identical results and the same ``state.state_dict()`` /
``state.stats()``. Pair the state with its optimizer before the first step,
``state.pair(optimizer)``: int8's ``block_size`` and powersgd's ``rank`` default
to ``auto``, which is chosen by the optimizer (ddpx/comm_hooks/comm_state.py).

Each compression method is one descriptor, a :class:`Method` in the ``METHODS`` of
its algorithm module (ddpx/comm_hooks/registry.py): :func:`method` finds it by name,
:func:`methods` lists them.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .comm_state import CommState
from .registry import (EXACT_KIND, INTER_NODE_KIND, Method, check_native_kinds, method, method_for_optimizer, methods,
                       native_kinds)
from .state import HookState, hook

log = logging.getLogger("ddpx.comm_hooks")

__all__ = ["make", "register", "available", "ddp_options", "needs_optimizer", "without_warmup", "method", "methods",
           "method_for_optimizer", "make_state", "Method", "CommState", "HookState", "hook", "check_native_kinds",
           "native_kinds", "compression_coverage"]

_FALLBACK_LOGGED: set[str] = set()


def available(with_optimizer: bool = False) -> list[str]:
    """Names accepted by :func:`make` and :func:`register`: the hooks that average the
    gradients by themselves, and with ``with_optimizer`` also those that need their
    optimizer to do it (``onebit_adam``: ``ddpx.optim.OneBitAdam``)."""
    return [m.name for m in methods() if with_optimizer or m.optimizer is None]


def ddp_options(name: str) -> dict:
    """``DistributedDataParallel`` keyword arguments hook `name` works best with,
    e.g. ``DDP(model, **ddpx.comm_hooks.ddp_options("int8"))``
    (``{"gradient_as_bucket_view": True, "bucket_cap_mb": 4.0}``). The ddpx
    trainer applies them itself."""
    return method(name).ddp_options()


def needs_optimizer(name: str) -> str | None:
    """The optimizer (import path) hook `name` must be paired with, or None (``onebit_adam``:
    ``"ddpx.optim.OneBitAdam"``, which averages the gradients in its compressed stage)."""
    return method(name).optimizer


def without_warmup(name: str) -> dict:
    """Options that make hook `name` compress from its first step (``{"warmup_steps": 0}``
    where it warms up, else none): for one-off calls, checks and timings, which are not
    training steps."""
    return {"warmup_steps": 0} if "warmup_steps" in method(name).options else {}


def make_state(name: str, process_group=None, **options) -> HookState:
    """The DDP comm-hook state of method ``name`` (``method(name).make_state``)."""
    return method(name).make_state(process_group, **options)


def make(name: str, process_group=None, **options):
    """Return ``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    The pair also works as Lightning's ``DDPStrategy(ddp_comm_state=state,
    ddp_comm_hook=hook)``. ``process_group`` defaults to the world group;
    unknown or invalid options raise :class:`ddpx.DdpxError`. Call
    ``state.pair(optimizer)`` before the first step.
    """
    state = make_state(name, process_group, **options)
    _announce_warmup(state)
    return state, hook


def _announce_warmup(state) -> None:
    """A hook with warm-up steps sends exact fp32 first, so a short trial shows no compression
    at all: say when compression starts, once per registration, on rank 0 (as the onebit-with-Adam
    warning, through the ``ddpx.comm_hooks`` logger, which a plain script shows too)."""
    steps = state.opts.get("warmup_steps", 0)
    if not steps or (dist.is_initialized() and dist.get_rank() != 0):
        return
    log.warning("comm hook %s: %s (option warmup_steps; comm_hook.options.warmup_steps in a ddpx config)",
                state.name, state.warmup_text.format(n=steps))


def compression_coverage(module: torch.nn.Module, state) -> str | None:
    """What a lossy hook compresses of ``module``'s gradients, in words: "N of M parameters
    compressed (P% of the elements; min_numel=... leaves K small tensors in fp32, ...)"; None
    for an exact hook. Said at install: on a small model ``min_numel`` may leave most of the
    bytes uncompressed."""
    if not state.lossy:
        return None
    params = [p for p in module.parameters() if p.requires_grad]
    compressed = [p for p in params if state.compressible(p)]
    exempt = [p for p in params if not state.compressible(p)]
    small = sum(1 for p in exempt if p.dim() > 1)
    vectors = len(exempt) - small
    done, total = sum(p.numel() for p in compressed), sum(p.numel() for p in params)
    why = ["all of the elements" if done == total else f"{100 * done / max(total, 1):.1f}% of the elements"]
    if small:
        why.append(f"min_numel={state.opts['min_numel']} leaves {small} small tensor{'s' * (small > 1)} in fp32")
    if vectors:
        switch = ", compress_vectors=false" if "compress_vectors" in state.opts else ""
        why.append(f"{vectors} vector{'s' * (vectors > 1)} (biases, norms) in fp32{switch}")
    return f"{len(compressed)} of {len(params)} parameters compressed ({'; '.join(why)})"


def _warn_if_nothing_compresses(ddp_model, state) -> None:
    """A lossy hook whose options exempt every parameter of the model (small matrices
    under ``min_numel``) sends plain fp32 and compresses nothing: say so."""
    module = getattr(ddp_model, "module", None)
    if not state.lossy or not isinstance(module, torch.nn.Module):
        return
    params = [p for p in module.parameters() if p.requires_grad]
    if not params or any(state.compressible(p) for p in params):
        return
    log.warning("ddpx.comm_hooks.register(%r): no parameter of this model is compressed (the largest has %d "
                "elements, min_numel is %d): every gradient travels as plain fp32; lower min_numel to compress "
                "smaller matrices", state.name, max(p.numel() for p in params), state.opts["min_numel"])


def _native_kind(state) -> str | None:
    """The C++ algorithm that runs `state` with its resolved scope (ddpx/comm_hooks/scope.py)."""
    kind = state.method.native
    plan = state.scope_plan() if hasattr(state, "scope_plan") else None
    if plan is None or kind is None:
        return kind
    return EXACT_KIND if plan == "exact" else INTER_NODE_KIND


def _native_unavailable(ddp_model, state) -> str | None:
    """Why the native hook cannot be used here, or None."""
    kind = _native_kind(state)
    if kind is None:
        return f"hook {state.name!r} has no native implementation"
    try:
        from .. import _C
    except ImportError as exc:  # pragma: no cover - the extension is part of the install
        return f"the ddpx._C extension failed to load ({exc})"
    if not getattr(_C, "has_native_hooks", False):
        return "this ddpx._C build has no native comm hooks (torch without distributed headers)"
    check_native_kinds(_C.native_hook_kinds())  # a stale build is an error, not a slower run
    if getattr(ddp_model, "reducer", None) is None:
        return f"{type(ddp_model).__name__} has no DDP reducer"
    return None


def register(ddp_model, name: str, native: bool = True, **options) -> HookState:
    """Register hook `name` on a ``DistributedDataParallel`` model; returns its state.

    With ``native=True`` the C++ hook runs on the model's reducer. Where this
    torch build or the model cannot take it, the Python hook is registered
    instead and the reason is logged once; an extension whose native algorithms
    are not this package's (a stale build) raises :class:`DdpxError`. Call
    ``state.pair(optimizer)`` before the first step.
    """
    state = make_state(name, getattr(ddp_model, "process_group", None), **options)
    _announce_warmup(state)
    _warn_if_nothing_compresses(ddp_model, state)
    native = native and state.method.native is not None  # a hook without a C++ twin (onebit_adam): nothing to warn
    reason = _native_unavailable(ddp_model, state) if native else "native=False"
    if reason is None:
        from .. import _C

        try:
            kind = _native_kind(state)
            executor_group = state.executor_group if state.multi_phase and kind == state.method.native else None
            state._native_close = _C.register_native_comm_hook(ddp_model.reducer, state.process_group,
                                                               executor_group, state, kind)
        except (TypeError, RuntimeError) as exc:
            reason = f"the reducer did not accept the native hook ({exc})"
        else:
            state.native = True
            return state
    if native and reason not in _FALLBACK_LOGGED:
        _FALLBACK_LOGGED.add(reason)
        log.warning("ddpx.comm_hooks.register(%r): using the Python hook: %s", name, reason)
    ddp_model.register_comm_hook(state, hook)
    return state

"""DDP communication hooks with fused compression kernels.

Plain DDP script::

    state, hook = ddpx.comm_hooks.make("int8")          # or "fp16", "bf16", "allreduce"
    ddp_model.register_comm_hook(state, hook)

or, with the native C++ hook (no Python and no GIL per bucket)::

    state = ddpx.comm_hooks.register(ddp_model, "int8", warmup_steps=10)

Both give identical results and the same ``state.state_dict()`` /
``state.stats()``. Each algorithm is one module in this package that lists its
state classes in ``HOOKS``; a class's ``name`` is the hook's name (``available()``
lists them) and its ``native_kind`` the C++ algorithm that runs it natively.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil

import torch
import torch.distributed as dist

from ..errors import DdpxError
from .state import HookState, hook

log = logging.getLogger("ddpx.comm_hooks")

__all__ = ["make", "register", "available", "ddp_options", "needs_optimizer", "without_warmup", "HookState", "hook"]

_REGISTRY: dict[str, type] | None = None
_FALLBACK_LOGGED: set[str] = set()
# The native kinds of the resolved scopes (ddpx/comm_hooks/scope.py): the exact plan runs the
# allreduce algorithm; inter_node its own, whose stage 2 is the hook's phase_kind.
_EXACT_KIND, _INTER_NODE_KIND = "allreduce", "inter_node"


def _registry() -> dict[str, type]:
    global _REGISTRY
    if _REGISTRY is None:
        found: dict[str, type] = {}
        for info in pkgutil.iter_modules(__path__):
            if info.name.startswith("_") or info.name in ("state", "executor"):
                continue
            module = importlib.import_module(f".{info.name}", __name__)
            for cls in getattr(module, "HOOKS", ()):
                if cls.name in found:
                    raise DdpxError(f"comm hook {cls.name!r} is defined twice: {found[cls.name].__qualname__} "
                                    f"and {cls.__qualname__}; give each state class its own name")
                found[cls.name] = cls
        _REGISTRY = dict(sorted(found.items()))
    return _REGISTRY


def available(with_optimizer: bool = False) -> list[str]:
    """Names accepted by :func:`make` and :func:`register`: the hooks that average the
    gradients by themselves, and with ``with_optimizer`` also those that need their
    optimizer to do it (``onebit_adam``: ``ddpx.optim.OneBitAdam``)."""
    return [name for name, cls in _registry().items() if with_optimizer or not cls.needs_optimizer]


def _state_class(name: str) -> type:
    cls = _registry().get(name)
    if cls is None:
        raise DdpxError(f"unknown comm hook {name!r}; available: {', '.join(available())}")
    return cls


def ddp_options(name: str) -> dict:
    """``DistributedDataParallel`` keyword arguments hook `name` works best with,
    e.g. ``DDP(model, **ddpx.comm_hooks.ddp_options("int8"))``
    (``{"gradient_as_bucket_view": True, "bucket_cap_mb": 4.0}``). The ddpx
    trainer applies them itself."""
    cls = _state_class(name)
    options = {"gradient_as_bucket_view": cls.gradient_as_bucket_view}
    if cls.bucket_cap_mb is not None:
        options["bucket_cap_mb"] = cls.bucket_cap_mb
    return options


def needs_optimizer(name: str) -> str | None:
    """The optimizer (import path) hook `name` must be paired with, or None (``onebit_adam``:
    ``"ddpx.optim.OneBitAdam"``, which averages the gradients in its compressed stage)."""
    return _state_class(name).needs_optimizer


def without_warmup(name: str) -> dict:
    """Options that make hook `name` compress from its first step (``{"warmup_steps": 0}``
    where it warms up, else none): for one-off calls, checks and timings, which are not
    training steps."""
    return {"warmup_steps": 0} if "warmup_steps" in _state_class(name).options else {}


def make_state(name: str, process_group=None, **options) -> HookState:
    return _state_class(name)(process_group=process_group, **options)


def make(name: str, process_group=None, **options):
    """Return ``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    The pair also works as Lightning's ``DDPStrategy(ddp_comm_state=state,
    ddp_comm_hook=hook)``. ``process_group`` defaults to the world group;
    unknown or invalid options raise :class:`ddpx.DdpxError`.
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
                "smaller matrices", state.name, max(p.numel() for p in params), state.min_numel)


def _native_kind(state) -> str | None:
    """The C++ algorithm that runs `state` with its resolved scope (ddpx/comm_hooks/scope.py)."""
    plan = state.scope_plan() if hasattr(state, "scope_plan") else None
    if plan is None or state.native_kind is None:
        return state.native_kind
    return _EXACT_KIND if plan == "exact" else _INTER_NODE_KIND


# One name table a side, compared here: the C++ algorithms register themselves
# (DDPX_REGISTER_NATIVE_HOOK in csrc/comm_hooks/<algorithm>.cpp, listed by native_hook_kinds)
# and the Python states say which one runs each hook (native_kind: fp16 and bf16 share
# "cast"; a scope may pick another). A third list, generated or passed across, would be one
# more place to keep in step; comparing the two catches a change made on one side only.
def native_kinds() -> set[str]:
    """The C++ algorithms the Python states can ask ``ddpx._C`` for."""
    kinds = {_EXACT_KIND, _INTER_NODE_KIND}
    for cls in _registry().values():
        kinds.update(k for k in (cls.native_kind, getattr(cls, "phase_kind", None)) if k)
    return kinds


def check_native_kinds(built) -> None:
    """Raise :class:`DdpxError` unless `built` (``ddpx._C.native_hook_kinds()``, one entry
    per registration) names each of :func:`native_kinds` once and nothing else."""
    built = list(built)
    problems = [f"{what}: {', '.join(sorted(kinds))}" for what, kinds in (
        ("named by a Python state but not built", native_kinds() - set(built)),
        ("built but named by no Python state", set(built) - native_kinds()),
        ("registered more than once", {k for k in built if built.count(k) > 1})) if kinds]
    if problems:
        raise DdpxError(f"ddpx._C does not match ddpx.comm_hooks ({'; '.join(problems)}): rebuild the extension "
                        "(pip install -e .); in csrc/comm_hooks/, one DDPX_REGISTER_NATIVE_HOOK per native_kind")


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
    are not this package's (a stale build) raises :class:`DdpxError`.
    """
    state = make_state(name, getattr(ddp_model, "process_group", None), **options)
    _announce_warmup(state)
    _warn_if_nothing_compresses(ddp_model, state)
    native = native and state.native_kind is not None  # a hook without a C++ twin (onebit_adam): nothing to warn
    reason = _native_unavailable(ddp_model, state) if native else "native=False"
    if reason is None:
        from .. import _C

        try:
            kind = _native_kind(state)
            executor_group = state.executor_group if state.multi_phase and kind == state.native_kind else None
            state._native_close, state._native_drop_layouts = _C.register_native_comm_hook(
                ddp_model.reducer, state.process_group, executor_group, state, kind)
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

"""One descriptor per compression method, and the one registry that finds them.

Each algorithm module of this package declares ``METHODS``, a tuple of :class:`Method`:
everything ddpx knows about a method in one place (its options, the DDP state that runs
it, its native twin, its sharded form, the optimizer it needs, the DDP settings it works
best with). :func:`method` looks one up by name, :func:`methods` lists them; the public
helpers of ``ddpx.comm_hooks`` (``make``, ``register``, ``available``, ``ddp_options``,
``needs_optimizer``) and the trainer's comm_hook plugin go through it.

Adding a method (docs/comm_hooks.md, "Adding a hook"): one module with a state class and
one ``Method(...)`` in its ``METHODS``.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field

import torch

from ..errors import DdpxError
from .options import Option, validate_options

# The native algorithms of the resolved scopes (ddpx/comm_hooks/scope.py): scope inter_node on
# one node runs the allreduce algorithm, on more its own, whose stage 2 is a method's.
EXACT_KIND, INTER_NODE_KIND = "allreduce", "inter_node"


@dataclass(frozen=True)
class Method:
    """A compression method.

    ``name``: what ``comm_hook.name`` and ``ddpx.comm_hooks.make`` take.
    ``state``: the DDP comm-hook state class (a ``ddpx.comm_hooks.state.HookState``), made by
    :meth:`make_state`; it runs the Python hook and owns what the native one uses.
    ``options``: the one dict of its :class:`~ddpx.comm_hooks.options.Option`, checked by
    :meth:`check_options`.
    ``native``: the C++ algorithm that runs it natively (its ``DDPX_REGISTER_NATIVE_HOOK``
    kind in csrc/comm_hooks/), or None; ``native_stage2``: the one that runs it as stage 2
    of ``scope: inter_node`` where that is another (fp16/bf16: ``cast_phases``).
    ``sharded``: its FSDP2 reduce-scatter class (a ``reduce_scatter.CompressedReduceScatter``),
    or None where it has none; ``sharded_options``: the options that one takes.
    ``optimizer``: the optimizer (import path) that must step with it because it averages
    the gradients itself (``onebit_adam``: ``ddpx.optim.OneBitAdam``), or None.
    ``bucket_cap_mb``, ``gradient_as_bucket_view``: the DDP settings it works best with
    (:meth:`ddp_options`; None: DDP's 25 MB).
    """

    name: str
    state: type
    options: dict[str, Option] = field(default_factory=dict)
    native: str | None = None
    native_stage2: str | None = None
    sharded: type | None = None
    sharded_options: tuple[str, ...] = ()
    optimizer: str | None = None
    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = True

    def __post_init__(self):
        unknown = [k for k in self.sharded_options if k not in self.options]
        if unknown or (self.sharded_options and self.sharded is None):
            raise DdpxError(f"comm hook {self.name!r}: sharded_options {', '.join(self.sharded_options)} need a "
                            f"sharded form taking options of its own ({', '.join(self.options) or 'none'})")

    def check_options(self, options: dict, sharded: bool = False) -> dict:
        """``options`` checked and completed with the defaults (``sharded``: the options of the
        sharded form); a bad one is a one-line :class:`DdpxError`."""
        if sharded:
            return validate_options(f"comm hook {self.name!r} under trainer.strategy=fsdp",
                                    {k: self.options[k] for k in self.sharded_options}, options)
        return validate_options(f"comm hook {self.name!r}", self.options, options)

    def make_state(self, process_group=None, **options):
        """The DDP comm-hook state (``ddp.register_comm_hook(state, ddpx.comm_hooks.hook)``;
        ``ddpx.comm_hooks.register`` also runs it natively)."""
        return self.state(self, process_group, **options)

    def make_sharded(self, **options):
        """The FSDP2 gradient reduce-scatter (``reduce_scatter.install(model, comm)``); a method
        without one, or a torch without ``FSDPModule.set_custom_reduce_scatter``, is refused
        in one line."""
        if self.sharded is None:
            raise DdpxError(f"comm hook {self.name!r} has no reduce-scatter for trainer.strategy=fsdp; choose one "
                            f"of: {', '.join(m.name for m in methods() if m.sharded is not None)}")
        from torch.distributed.fsdp import FSDPModule

        if not hasattr(FSDPModule, "set_custom_reduce_scatter"):
            raise DdpxError(f"comm hook {self.name!r} under trainer.strategy=fsdp needs "
                            f"FSDPModule.set_custom_reduce_scatter, which torch {torch.__version__} lacks (2.13 has "
                            "it); upgrade torch, or set comm_hook.name=allreduce")
        return self.sharded(self, **options)

    def ddp_options(self) -> dict:
        """``DistributedDataParallel`` keyword arguments it works best with."""
        out = {"gradient_as_bucket_view": self.gradient_as_bucket_view}
        if self.bucket_cap_mb is not None:
            out["bucket_cap_mb"] = self.bucket_cap_mb
        return out

    def native_kinds(self) -> set[str]:
        """The C++ algorithms it may ask ``ddpx._C`` for."""
        return {k for k in (self.native, self.native_stage2) if k}


_METHODS: dict[str, Method] | None = None


def _discover() -> dict[str, Method]:
    """Every ``METHODS`` entry of this package's modules, by name."""
    from . import __path__ as package_path

    found: dict[str, Method] = {}
    for info in pkgutil.iter_modules(package_path):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__package__}.{info.name}")
        for m in getattr(module, "METHODS", ()):
            if m.name in found:
                raise DdpxError(f"comm hook {m.name!r} is declared twice: {found[m.name].state.__qualname__} and "
                                f"{m.state.__qualname__}; give each method its own name")
            found[m.name] = m
    return dict(sorted(found.items()))


def methods() -> list[Method]:
    """Every compression method, by name."""
    global _METHODS
    if _METHODS is None:
        _METHODS = _discover()
    return list(_METHODS.values())


def method(name: str) -> Method:
    """The method called ``name``; an unknown name is a one-line :class:`DdpxError` listing
    the choices."""
    methods()
    found = _METHODS.get(name)
    if found is None:
        choices = ", ".join(m.name for m in methods() if m.optimizer is None)
        raise DdpxError(f"unknown comm hook {name!r}; available: {choices}")
    return found


def method_for_optimizer(optimizer_class: type) -> Method | None:
    """The method an optimizer class must step with (its ``Method.optimizer`` is the class or
    a base of it), or None."""
    from ..imports import resolve

    if not isinstance(optimizer_class, type):
        return None
    for m in methods():
        if m.optimizer is not None and issubclass(optimizer_class, resolve(m.optimizer, "optimizer")):
            return m
    return None


# One name table a side, compared here: the C++ algorithms register themselves
# (DDPX_REGISTER_NATIVE_HOOK in csrc/comm_hooks/<algorithm>.cpp, listed by native_hook_kinds)
# and the descriptors say which one runs each method (``native``: fp16 and bf16 share
# "cast"; a scope may pick another). A third list, generated or passed across, would be one
# more place to keep in step; comparing the two catches a change made on one side only.
def native_kinds() -> set[str]:
    """The C++ algorithms the methods can ask ``ddpx._C`` for."""
    kinds = {EXACT_KIND, INTER_NODE_KIND}
    for m in methods():
        kinds |= m.native_kinds()
    return kinds


def check_native_kinds(built) -> None:
    """Raise :class:`DdpxError` unless `built` (``ddpx._C.native_hook_kinds()``, one entry
    per registration) names each of :func:`native_kinds` once and nothing else."""
    built = list(built)
    problems = [f"{what}: {', '.join(sorted(kinds))}" for what, kinds in (
        ("named by a method but not built", native_kinds() - set(built)),
        ("built but named by no method", set(built) - native_kinds()),
        ("registered more than once", {k for k in built if built.count(k) > 1})) if kinds]
    if problems:
        raise DdpxError(f"ddpx._C does not match ddpx.comm_hooks ({'; '.join(problems)}): rebuild the extension "
                        "(pip install -e .); in csrc/comm_hooks/, one DDPX_REGISTER_NATIVE_HOOK per Method.native")

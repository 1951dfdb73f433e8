"""Install a ddpx gradient-communication hook on the DDP model, chosen by name.

``name: allreduce`` (the default) keeps DDP's own fp32 all-reduce and installs
nothing. Any other name is looked up in ``ddpx.comm_hooks.available()`` (e.g.
``fp16``, ``int8``, ``powersgd``) and registered with
``ddpx.comm_hooks.register(model, name, native=..., **options)``; ``native: true``
selects the C++ hook that runs without Python per bucket, where the algorithm
has one. The hook's state (error feedback, warm starts) is saved in checkpoints
(key ``"comm_hook"``). If ``ddpx.comm_hooks`` cannot be imported, training falls
back to DDP's all-reduce and says so once. The DDP bucket size the hook works
best with (``ddpx.comm_hooks.ddp_options``: 4 MB for ``int8``) is passed to the trainer's
DDP wrap unless ``trainer.bucket_cap_mb`` sets one, and so is
``gradient_as_bucket_view=True`` (the hook writes into the bucket, so DDP's copy
back into ``.grad`` is saved).

The strategy installs it (``trainer.strategy``: ``use_compression`` before the wrap, so DDP
sizes its buckets for the hook, ``install_compression`` after) and decides where it applies.

An optimizer that averages the gradients itself names its hook (``comm_hook``
class attribute): ``optimizer.target: ddpx.optim.OneBitAdam`` registers
``onebit_adam`` (with ``comm_hook.options``) and pairs the two at train start;
any other ``comm_hook.name`` with it, or ``onebit_adam`` without it, is a one-line
config error.

Under ``trainer.strategy: fsdp`` there is no DDP bucket: ``fp16``, ``bf16`` and
``int8`` become FSDP2's gradient reduce-scatter on every FSDP unit
(``ddpx.comm_hooks.reduce_scatter``, with ``comm_hook.options``: int8's ``block_size``),
with ``fsdp.reduce_dtype: fp32``; ``allreduce`` keeps FSDP's own reduce-scatter; any
other name is a one-line config error. ``comm_hook.native`` does not apply there (the
reduce-scatter is Python around ddpx's native kernels).

Config section ``comm_hook``: ``name`` (``allreduce``), ``native`` (true),
``options`` (``{}``: keyword arguments of the hook, e.g. ``{rank: 4}``).

The plugin is one :class:`CommHookPlugin` object; ``trainer.plugin("comm_hook").state``
is the registered hook's state (None: DDP's own all-reduce), shared with the other
plugins as ``trainer.shared[COMM_HOOK]``.
"""

import importlib
from ddpx import hookimpl
from ddpx.config.strategies import strategy_class
from ddpx.errors import DdpxError
from ddpx.imports import resolve
from ddpx.plugin.shared import COMM_HOOK

BUILTIN = "allreduce"  # DDP's own all-reduce: no hook


def _hooks_module():
    """``ddpx.comm_hooks``, or None where it (or the extension it needs) is missing."""
    try:
        hooks = importlib.import_module("ddpx.comm_hooks")
    except ImportError:
        return None
    return hooks if hasattr(hooks, "register") and hasattr(hooks, "available") else None


def hook_name(config, hooks) -> str:
    """The hook a run uses: ``comm_hook.name``, or the one the optimizer needs (its class's
    ``comm_hook``, e.g. ``ddpx.optim.OneBitAdam``: ``onebit_adam``); a mismatch is a DdpxError."""
    name = config.section("comm_hook")["name"]
    target = config.optimizer.target
    paired = getattr(resolve(target, "optimizer.target"), "comm_hook", None)
    if paired is not None and name not in (BUILTIN, paired):
        raise DdpxError(f"optimizer.target {target} averages the gradients through comm hook {paired!r}: set "
                        f"comm_hook.name: {paired} (or leave it at {BUILTIN}), not {name!r}")
    name = paired or name
    available = list(hooks.available(with_optimizer=True))
    if name != BUILTIN and name not in available:
        choices = [BUILTIN, *(n for n in available if n != BUILTIN)]
        raise DdpxError(f"unknown comm_hook.name {name!r}; choose one of: {', '.join(choices)}")
    needs = None if name == BUILTIN else hooks.needs_optimizer(name)
    if needs and paired is None:
        raise DdpxError(f"comm_hook.name {name} needs optimizer.target: {needs} (it takes torch.optim.AdamW's "
                        f"arguments), not {target}")
    return name


class CommHookPlugin:
    """The comm hook of a run: ``state`` is the registered hook's state, or None."""

    def __init__(self):
        self.state = None
        self.name = BUILTIN

    @hookimpl
    def ddpx_config_defaults(self):
        return {"comm_hook": {"name": BUILTIN, "native": True, "options": {}}}

    @hookimpl
    def ddpx_configure(self, config):
        cfg = config.section("comm_hook")
        hooks = _hooks_module()
        if hooks is None:
            return
        name = hook_name(config, hooks)
        if name != BUILTIN:  # bad options, or a hook the strategy cannot use, fail here, before any worker starts
            strategy_class(config.trainer.strategy).check_compression(config, name, cfg["options"])

    @hookimpl
    def ddpx_setup(self, trainer):
        cfg = trainer.config.section("comm_hook")
        hooks = _hooks_module()
        self.state, self.name = None, cfg["name"]
        if hooks is None:
            if self.name != BUILTIN:
                trainer.log.warning(
                    "ddpx.comm_hooks is not available; comm_hook.name=%s falls back to DDP's all-reduce", self.name
                )
            self.name = BUILTIN
            return
        self.name = hook_name(trainer.config, hooks)
        if self.name != BUILTIN:  # before the wrap: DDP sizes its buckets for the hook
            trainer.strategy.use_compression(self.name, cfg["options"], cfg["native"])

    @hookimpl
    def ddpx_train_start(self, trainer):
        if self.state is not None and getattr(self.state, "needs_optimizer", None):
            trainer.optimizer.pair(self.state)  # the optimizer averages the momentum through the hook

    @hookimpl
    def ddpx_model_wrapped(self, trainer, model):
        if self.name != BUILTIN:
            self.state = trainer.strategy.install_compression(trainer, model)
            if self.state is not None:
                trainer.shared[COMM_HOOK] = self.state

    def state_dict(self, trainer):
        if self.state is None or not hasattr(self.state, "state_dict"):
            return None
        return {"name": self.name, "state": self.state.state_dict()}

    def load_state_dict(self, trainer, saved):
        if self.state is None or not hasattr(self.state, "load_state_dict"):
            return
        if saved["name"] != self.name:
            trainer.log.warning(
                "checkpoint has state of comm hook %s, this run uses %s: starting the hook fresh", saved["name"], self.name
            )
            return
        self.state.load_state_dict(saved["state"])

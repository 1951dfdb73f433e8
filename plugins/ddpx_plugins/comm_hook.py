"""Install a ddpx gradient-communication hook on the DDP model, chosen by name.

``name: allreduce`` (the default) keeps DDP's own fp32 all-reduce and installs
nothing. Any other name is a compression method of ``ddpx.comm_hooks``
(``ddpx.comm_hooks.method(name)``, e.g. ``fp16``, ``int8``, ``powersgd``), registered
with ``ddpx.comm_hooks.register(model, name, native=..., **options)``; ``native: true``
selects the C++ hook that runs without Python per bucket, where the method has one.
The hook's state (error feedback, warm starts) is saved in checkpoints (key
``"comm_hook"``). The DDP bucket size the method works best with
(``Method.ddp_options``: 4 MB for ``int8``) is passed to the trainer's DDP wrap unless
``trainer.bucket_cap_mb`` sets one, and so is ``gradient_as_bucket_view=True`` (the hook
writes into the bucket, so DDP's copy back into ``.grad`` is saved).

At ``ddpx_train_start`` (after the checkpoint plugin restored the state: a restored
``auto`` value stays) the state is paired with the run's optimizer,
``state.pair(trainer.optimizer)``, before any bucket is coded: int8's ``block_size: auto``
and powersgd's ``rank: auto`` take their Adam-family values with Adam or AdamW.

An optimizer that averages the gradients itself is named by its method's descriptor
(``Method.optimizer``): ``optimizer.target: ddpx.optim.OneBitAdam`` registers
``onebit_adam`` (with ``comm_hook.options``) and pairs the two at train start;
any other ``comm_hook.name`` with it, or ``onebit_adam`` without it, is a one-line
config error.

The run's strategy decides where the method applies and installs it (``trainer.strategy``:
``check_compression`` in the launcher, ``use_compression`` before the wrap, so that DDP sizes
its buckets for the hook, ``install_compression`` after). Under ``trainer.strategy: fsdp``
there is no DDP bucket: the methods with a sharded form (``Method.sharded``: ``fp16``,
``bf16``, ``int8``) become FSDP2's gradient reduce-scatter on every FSDP unit
(``ddpx.comm_hooks.reduce_scatter``, with ``comm_hook.options``: int8's ``block_size``), with
``fsdp.reduce_dtype: fp32``; ``allreduce`` keeps FSDP's own reduce-scatter; any other name is
a one-line config error. ``comm_hook.native`` does not apply there (the reduce-scatter is
Python around ddpx's native kernels).

Config section ``comm_hook``: ``name`` (``allreduce``), ``native`` (true),
``options`` (``{}``: keyword arguments of the hook, e.g. ``{rank: 4}``).

The plugin is one :class:`CommHookPlugin` object; ``trainer.plugin("comm_hook").state``
is the run's comm state (``ddpx.comm_hooks.CommState``; None: DDP's own all-reduce),
shared with the other plugins as ``trainer.shared[COMM_HOOK]``.

``ddpx.comm_hooks`` (and torch with it) is imported where a method is looked up, not with
this module: listing the plugins and checking the config's keys need no torch.
"""


from ddpx import hookimpl
from ddpx.config.strategies import run_strategy_class
from ddpx.errors import DdpxError
from ddpx.imports import resolve
from ddpx.plugin.shared import COMM_HOOK

BUILTIN = "allreduce"  # DDP's own all-reduce: no hook


def hook_name(config) -> str:
    """The hook a run uses: ``comm_hook.name``, or the method the optimizer needs (the one whose
    ``Method.optimizer`` it is, e.g. ``ddpx.optim.OneBitAdam``: ``onebit_adam``); a mismatch is
    a DdpxError."""
    from ddpx import comm_hooks

    name = config.section("comm_hook")["name"]
    target = config.optimizer.target
    needed = comm_hooks.method_for_optimizer(resolve(target, "optimizer.target"))
    paired = needed.name if needed is not None else None
    if paired is not None and name not in (BUILTIN, paired):
        raise DdpxError(f"optimizer.target {target} averages the gradients through comm hook {paired!r}: set "
                        f"comm_hook.name: {paired} (or leave it at {BUILTIN}), not {name!r}")
    name = paired or name
    available = comm_hooks.available(with_optimizer=True)
    if name != BUILTIN and name not in available:
        choices = [BUILTIN, *(n for n in available if n != BUILTIN)]
        raise DdpxError(f"unknown comm_hook.name {name!r}; choose one of: {', '.join(choices)}")
    needs = None if name == BUILTIN else comm_hooks.method(name).optimizer
    if needs and paired is None:
        raise DdpxError(f"comm_hook.name {name} needs optimizer.target: {needs} (it takes torch.optim.AdamW's "
                        f"arguments), not {target}")
    return name


class CommHookPlugin:
    """The comm hook of a run: ``state`` is the installed method's state, or None."""

    def __init__(self):
        self.state = None
        self.name = BUILTIN

    @hookimpl
    def ddpx_config_defaults(self):
        return {"comm_hook": {"name": BUILTIN, "native": True, "options": {}}}

    @hookimpl
    def ddpx_configure(self, config):
        from ddpx import comm_hooks

        name = hook_name(config)
        if name != BUILTIN:  # bad options, or a method the strategy cannot use, fail here, before any worker starts
            run_strategy_class(config).check_compression(
                config, comm_hooks.method(name), config.section("comm_hook")["options"])

    @hookimpl
    def ddpx_setup(self, trainer):
        from ddpx import comm_hooks

        cfg = trainer.config.section("comm_hook")
        self.state, self.name = None, hook_name(trainer.config)
        if self.name != BUILTIN:  # before the wrap: DDP sizes its buckets for the hook
            trainer.strategy.use_compression(comm_hooks.method(self.name), cfg["options"], cfg["native"])

    @hookimpl
    def ddpx_model_wrapped(self, trainer, model):
        if self.name != BUILTIN:
            self.state = trainer.strategy.install_compression(trainer, model)
            if self.state is not None:
                trainer.shared[COMM_HOOK] = self.state

    @hookimpl
    def ddpx_train_start(self, trainer):
        # after the checkpoint plugin's restore (tryfirst), before any bucket is coded: the auto
        # options take the optimizer's values, and OneBitAdam gets the hook it averages through
        if self.state is not None:
            self.state.pair(trainer.optimizer)

    def state_dict(self, trainer):
        state = self.state.state_dict() if self.state is not None else None
        return None if state is None else {"name": self.name, "state": state}

    def load_state_dict(self, trainer, saved):
        if self.state is None:
            return
        if saved["name"] != self.name:
            trainer.log.warning(
                "checkpoint has state of comm hook %s, this run uses %s: starting the hook fresh", saved["name"], self.name
            )
            return
        self.state.load_state_dict(saved["state"])

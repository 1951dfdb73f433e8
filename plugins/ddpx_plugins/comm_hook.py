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

Under ``trainer.strategy: fsdp`` there is no DDP bucket: the methods with a sharded
form (``Method.sharded``: ``fp16``, ``bf16``, ``int8``) become FSDP2's gradient
reduce-scatter on every FSDP unit (``ddpx.comm_hooks.reduce_scatter``, with
``comm_hook.options``: int8's ``block_size``), with ``fsdp.reduce_dtype: fp32``;
``allreduce`` keeps FSDP's own reduce-scatter; any other name is a one-line config
error. ``comm_hook.native`` does not apply there (the reduce-scatter is Python around
ddpx's native kernels).

Config section ``comm_hook``: ``name`` (``allreduce``), ``native`` (true),
``options`` (``{}``: keyword arguments of the hook, e.g. ``{rank: 4}``).

The plugin is one :class:`CommHookPlugin` object; ``trainer.plugin("comm_hook").state``
is the run's comm state (``ddpx.comm_hooks.CommState``; None: DDP's own all-reduce),
shared with the other plugins as ``trainer.shared[COMM_HOOK]``.
"""

from ddpx import comm_hooks, hookimpl
from ddpx.errors import DdpxError
from ddpx.imports import resolve
from ddpx.plugin.shared import COMM_HOOK

BUILTIN = "allreduce"  # DDP's own all-reduce: no hook


def hook_name(config) -> str:
    """The hook a run uses: ``comm_hook.name``, or the method the optimizer needs (the one whose
    ``Method.optimizer`` it is, e.g. ``ddpx.optim.OneBitAdam``: ``onebit_adam``); a mismatch is
    a DdpxError."""
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


def _check_under_fsdp(config, name) -> None:
    """Under fsdp the methods with a sharded form (``Method.sharded``) apply, on fp32
    gradients; any other is refused, as are options they do not take."""
    if config.trainer.strategy != "fsdp" or name == BUILTIN:
        return
    method = comm_hooks.method(name)
    if method.sharded is None:
        *first, last = sorted(m.name for m in comm_hooks.methods() if m.sharded is not None)
        raise DdpxError(f"plugin 'comm_hook': comm_hook.name={name} does not apply under trainer.strategy=fsdp (only "
                        f"{', '.join(first)} and {last} have a sharded reduce-scatter); set comm_hook.name=int8 "
                        f"(or {', '.join(first)}, {BUILTIN})")
    reduce_dtype = config.fsdp.reduce_dtype
    if reduce_dtype != "fp32":
        raise DdpxError(f"plugin 'comm_hook': comm_hook.name={name} under trainer.strategy=fsdp codes and sums fp32 "
                        f"gradients itself; set fsdp.reduce_dtype=fp32 (now {reduce_dtype}), or "
                        f"comm_hook.name={BUILTIN} to reduce-scatter in {reduce_dtype}")
    options = config.section("comm_hook")["options"]
    method.make_sharded(**options)  # bad options fail here
    shard_size = config.fsdp.get("shard_size", "all")
    if shard_size != "all" and options.get("scope", "global") != "global":
        raise DdpxError(f"plugin 'comm_hook': comm_hook.options.scope={options['scope']} does not apply under "
                        f"fsdp.shard_size={shard_size} (HSDP): the reduce-scatter runs inside each shard group and "
                        "the replicas' all-reduce is FSDP's own; remove the scope option, or set fsdp.shard_size=all")


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
        name = hook_name(config)
        if config.trainer.strategy == "fsdp":
            _check_under_fsdp(config, name)
            return
        if name == BUILTIN:
            return
        comm_hooks.method(name).check_options(cfg["options"])  # bad options fail here, before any worker starts

    @hookimpl
    def ddpx_ddp_options(self, trainer):
        name = hook_name(trainer.config)
        return None if name == BUILTIN else comm_hooks.method(name).ddp_options()

    @hookimpl
    def ddpx_train_start(self, trainer):
        # after the checkpoint plugin's restore (tryfirst), before any bucket is coded: the auto
        # options take the optimizer's values, and OneBitAdam gets the hook it averages through
        if self.state is not None:
            self.state.pair(trainer.optimizer)

    @hookimpl
    def ddpx_model_wrapped(self, trainer, model):
        from torch.nn.parallel import DistributedDataParallel

        cfg = trainer.config.section("comm_hook")
        self.state = None
        self.name = hook_name(trainer.config)
        if self.name == BUILTIN:
            return
        if trainer.config.trainer.strategy == "fsdp":
            self._install_reduce_scatter(trainer, model, cfg)
            return
        if not isinstance(model, DistributedDataParallel):
            trainer.log.warning("comm_hook.name=%s ignored: the model is not wrapped in DDP", self.name)
            return
        self.state = trainer.shared[COMM_HOOK] = comm_hooks.register(model, self.name, native=cfg["native"],
                                                                     **cfg["options"])
        kind = "native C++" if getattr(self.state, "native", False) else "Python"
        bucket_mb = getattr(model, "bucket_bytes_cap", 0) / 2**20
        views = ", gradients as bucket views" if getattr(model, "gradient_as_bucket_view", False) else ""
        trainer.log.info("comm hook %s installed (%s hook, DDP buckets of %g MB%s)", self.name, kind, bucket_mb, views)

    def _install_reduce_scatter(self, trainer, model, cfg):
        from ddpx.comm_hooks import reduce_scatter

        comm = comm_hooks.method(self.name).make_sharded(**cfg["options"])
        units = reduce_scatter.install(model, comm)
        self.state = trainer.shared[COMM_HOOK] = comm
        opts = "".join(f", {k} {v}" for k, v in comm.opts.items())
        shard_size = trainer.config.fsdp.get("shard_size", "all")
        hsdp = "" if shard_size == "all" else (f"; fsdp.shard_size={shard_size}: it runs inside each shard group, and "
                                                "the replicas' all-reduce stays FSDP's own, in fsdp.reduce_dtype")
        trainer.log.info("comm hook %s installed on %d fsdp units (reduce-scatter: %s codes, one all_to_all, fp32 "
                         "sum%s%s)", self.name, units, self.name, opts, hsdp)

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

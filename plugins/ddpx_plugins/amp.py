"""Automatic mixed precision: the forward pass under ``torch.autocast``.

``dtype: fp16`` uses a ``torch.amp.GradScaler``: the loss is scaled before
backward, gradients are unscaled before ``trainer.clip_gradients()`` (so
clipping sees true norms), and a step whose gradients overflowed (inf/NaN) is
skipped, the scale lowered and the skip counted (``amp_skipped_steps`` in the
epoch metrics; the optimizer step hook returns False, so the core does not step
the LR scheduler for it). Such a non-finite loss is not divergence
(``trainer.nonfinite``): only a loss scale that falls below 2^-16, every step
overflowing, is. ``dtype: bf16`` has fp32's range and needs no scaler.
Both work on CPU and CUDA. The scaler's state is saved in checkpoints (key
``"amp"``).

Config section ``amp``: ``enabled`` (false), ``dtype`` (``fp16`` | ``bf16``),
``init_scale`` (65536.0, fp16 only).

Per-run state lives in ``trainer.amp`` (an :class:`AmpState`, or None when
disabled), the per-step hooks in :class:`AutocastSteps` / :class:`ScaledSteps`,
attached (plugin ``amp.steps``) only when AMP is enabled: disabled, it costs
nothing per step (docs/plugins.md, "Per-run state").
"""

from ddpx import hookimpl
from ddpx.errors import DdpxError
from ddpx.plugin import attach

DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
# A loss scale this low means every step overflows (a loss that stays non-finite): divergence.
MIN_SCALE = 2.0 ** -16


class AmpState:
    """What one run of the AMP plugin holds (``trainer.amp``)."""

    def __init__(self, device_type, dtype, scaler):
        self.device_type = device_type
        self.dtype = dtype
        self.scaler = scaler  # None for bf16
        self.skipped_steps = 0


@hookimpl
def ddpx_config_defaults():
    return {"amp": {"enabled": False, "dtype": "fp16", "init_scale": 65536.0}}


@hookimpl
def ddpx_configure(config):
    cfg = config.section("amp")
    if cfg["dtype"] not in DTYPES:
        raise DdpxError(f"amp.dtype must be one of {', '.join(DTYPES)} (got {cfg['dtype']!r})")
    if not cfg["init_scale"] > 0:
        raise DdpxError(f"amp.init_scale must be positive (got {cfg['init_scale']})")


@hookimpl
def ddpx_setup(trainer):
    import torch

    cfg = trainer.config.section("amp")
    trainer.amp = None
    if not cfg["enabled"]:
        return  # no per-step hooks at all
    device_type = trainer.device.type
    dtype = getattr(torch, DTYPES[cfg["dtype"]])
    if not torch.amp.is_autocast_available(device_type):
        raise DdpxError(f"autocast is not available on device {device_type!r}; set amp.enabled=false")
    if device_type == "cuda" and dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise DdpxError("this GPU does not support bf16; set amp.dtype=fp16")
    scaler = None
    if dtype is torch.float16:
        scaler = torch.amp.GradScaler(device_type, init_scale=float(cfg["init_scale"]))
    trainer.amp = AmpState(device_type, dtype, scaler)
    # The scaler skips steps with non-finite gradients: a non-finite loss is an
    # overflow, not divergence, unless the scale collapses (see MIN_SCALE).
    trainer.skips_nonfinite_steps = scaler is not None
    pm = getattr(trainer, "plugin_manager", None)  # None: a unit test drives the hooks itself
    if pm is not None:
        attach(pm, AutocastSteps(trainer.amp) if scaler is None else ScaledSteps(trainer.amp), "amp.steps")


class AutocastSteps:
    """The per-step hooks of bf16 (attached only when AMP is on)."""

    def __init__(self, amp):
        self.amp = amp

    @hookimpl(wrapper=True)
    def ddpx_forward(self, trainer, batch):
        import torch

        with torch.autocast(self.amp.device_type, dtype=self.amp.dtype):
            return (yield)


class ScaledSteps(AutocastSteps):
    """The per-step hooks of fp16: autocast plus the GradScaler."""

    @hookimpl
    def ddpx_backward(self, trainer, loss):
        self.amp.scaler.scale(loss).backward()
        return True

    @hookimpl
    def ddpx_optimizer_step(self, trainer):
        amp, scaler = self.amp, self.amp.scaler
        scaler.unscale_(trainer.optimizer)
        trainer.clip_gradients()
        scale = scaler.get_scale()
        scaler.step(trainer.optimizer)  # skipped inside if any gradient is inf/NaN
        scaler.update()
        new_scale = scaler.get_scale()
        if new_scale < scale:  # update() backs the scale off only after an overflow
            amp.skipped_steps += 1
            if new_scale < MIN_SCALE:  # the same on every rank: the gradients were all-reduced
                trainer.nonfinite_loss(f"by optimizer step {trainer.global_step + 1} (epoch {trainer.epoch}): every "
                                       f"fp16 step overflowed until the loss scale fell to {new_scale:g}",
                                       by_step_skipper=True)
            return False
        return True


@hookimpl(tryfirst=True)  # before the logging plugin writes the epoch's metrics
def ddpx_epoch_end(trainer, epoch, metrics):
    amp = trainer.amp
    if amp is not None and amp.scaler is not None:
        metrics["amp_skipped_steps"] = amp.skipped_steps
        metrics["amp_scale"] = amp.scaler.get_scale()


@hookimpl
def ddpx_state_dict(trainer):
    amp = trainer.amp
    if amp is None or amp.scaler is None:
        return None
    return {"amp": {"scaler": amp.scaler.state_dict(), "skipped_steps": amp.skipped_steps}}


@hookimpl
def ddpx_load_state_dict(trainer, state):
    amp = trainer.amp
    if amp is None or amp.scaler is None or "amp" not in state:
        return
    amp.scaler.load_state_dict(state["amp"]["scaler"])
    amp.skipped_steps = int(state["amp"]["skipped_steps"])

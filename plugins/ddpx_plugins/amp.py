"""Automatic mixed precision: the forward pass under ``torch.autocast``.

``dtype: fp16`` adds a ``torch.amp.GradScaler``, which the trainer uses (see
``Trainer.train_step``): the loss is scaled before backward, gradients are
unscaled before ``trainer.clip_gradients()`` (so clipping sees true norms), and
a step whose gradients overflowed (inf/NaN) is skipped, the scale lowered and
the skip counted (``amp_skipped_steps`` in the epoch metrics; the LR scheduler
does not step for it). Such a non-finite loss is not divergence
(``trainer.nonfinite``): only a loss scale that falls below 2^-16, every step
overflowing, is. ``dtype: bf16`` has fp32's range and needs no scaler.
Both work on CPU and CUDA. The scaler's state is saved in checkpoints (key
``"amp"``).

Config section ``amp``: ``enabled`` (false), ``dtype`` (``fp16`` | ``bf16``),
``init_scale`` (65536.0, fp16 only).
"""

from ddpx import hookimpl
from ddpx.errors import DdpxError

DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


class AmpPlugin:
    """The run's ``autocast`` context and ``scaler`` (None when AMP is off; no scaler for bf16)."""

    def __init__(self):
        self.autocast = None
        self.scaler = None

    @hookimpl
    def ddpx_config_defaults(self):
        return {"amp": {"enabled": False, "dtype": "fp16", "init_scale": 65536.0}}

    @hookimpl
    def ddpx_configure(self, config):
        cfg = config.section("amp")
        if cfg["dtype"] not in DTYPES:
            raise DdpxError(f"amp.dtype must be one of {', '.join(DTYPES)} (got {cfg['dtype']!r})")
        if not cfg["init_scale"] > 0:
            raise DdpxError(f"amp.init_scale must be positive (got {cfg['init_scale']})")

    @hookimpl
    def ddpx_setup(self, trainer):
        import torch

        self.autocast = self.scaler = None
        cfg = trainer.config.section("amp")
        if not cfg["enabled"]:
            return
        device_type = trainer.device.type
        dtype = getattr(torch, DTYPES[cfg["dtype"]])
        if not torch.amp.is_autocast_available(device_type):
            raise DdpxError(f"autocast is not available on device {device_type!r}; set amp.enabled=false")
        if device_type == "cuda" and dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise DdpxError("this GPU does not support bf16; set amp.dtype=fp16")
        self.autocast = torch.autocast(device_type, dtype=dtype)
        if dtype is torch.float16:
            self.scaler = torch.amp.GradScaler(device_type, init_scale=float(cfg["init_scale"]))

    @hookimpl
    def ddpx_autocast(self, trainer):
        return self.autocast

    @hookimpl
    def ddpx_grad_scaler(self, trainer):
        return self.scaler

    @hookimpl(tryfirst=True)  # before the logging plugin writes the epoch's metrics
    def ddpx_epoch_end(self, trainer, epoch, metrics):
        if self.scaler is not None:
            metrics["amp_skipped_steps"] = trainer.skipped_steps
            metrics["amp_scale"] = self.scaler.get_scale()

    def state_dict(self, trainer):
        return None if self.scaler is None else {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, trainer, state):
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])

"""``trainer.strategy: ddp`` (the default): every rank holds the whole model; torch's
``DistributedDataParallel`` averages the gradients in buckets during backward, through a
ddpx comm hook when ``comm_hook.name`` compresses them."""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from .base import Strategy


def ddp_kwargs(config, preferred: Mapping) -> dict:
    """``DistributedDataParallel`` keyword arguments: what the comm hook works best with
    (``preferred``: its bucket size, gradients as bucket views) where the config leaves it open,
    then the config's ``trainer.find_unused_parameters``, ``static_graph`` and a non-null
    ``bucket_cap_mb`` and ``gradient_as_bucket_view``."""
    cfg = config.trainer
    configured = {"find_unused_parameters": cfg.find_unused_parameters, "static_graph": cfg.static_graph}
    for key in ("bucket_cap_mb", "gradient_as_bucket_view"):
        if cfg[key] is not None:
            configured[key] = cfg[key]
    return {**preferred, **configured}


class DDPStrategy(Strategy):
    """The model replicated on every rank, wrapped in ``DistributedDataParallel``."""

    @classmethod
    def check_compression(cls, config, method, options):
        method.check_options(options)  # unknown or bad options fail here

    def wrap(self, trainer, module):
        preferred = self.compression[0].ddp_options() if self.compression else {}
        device_ids = [trainer.device] if trainer.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(module, device_ids=device_ids,
                                                         **ddp_kwargs(trainer.config, preferred))

    def install_compression(self, trainer, model):
        from torch.nn.parallel import DistributedDataParallel

        from ..comm_hooks import compression_coverage, register

        if self.compression is None:
            return None
        method, options, native = self.compression
        name = method.name
        if not isinstance(model, DistributedDataParallel):
            trainer.log.warning("comm_hook.name=%s ignored: the model is not wrapped in DDP", name)
            return None
        state = register(model, name, native=native, **options)
        kind = "native C++" if getattr(state, "native", False) else "Python"
        bucket_mb = getattr(model, "bucket_bytes_cap", 0) / 2**20
        views = ", gradients as bucket views" if getattr(model, "gradient_as_bucket_view", False) else ""
        coverage = compression_coverage(model.module, state)
        trainer.log.info("comm hook %s installed (%s hook, DDP buckets of %g MB%s)%s", name, kind, bucket_mb, views,
                         f"; {coverage}" if coverage else "")
        return state

    def no_sync(self, model: nn.Module):
        return getattr(model, "no_sync", None)

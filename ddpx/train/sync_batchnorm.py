"""``trainer.sync_batchnorm``: BatchNorm statistics over the whole global batch.

torch's ``SyncBatchNorm`` refuses CPU tensors (and DDP refuses it in a CPU
module), so on CPU (gloo) the BatchNorm layers become :class:`CpuSyncBatchNorm`:
the same state (checkpoints do not change) whose training forward
all-reduces the per-channel sum, sum of squares and count in one collective,
differentiably: the backward pass sums the statistics' gradients across ranks,
as torch's CUDA version does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class _SumAcrossRanks(torch.autograd.Function):
    """All-reduce (sum) whose gradient is the all-reduced gradient (torch's
    ``torch.distributed.nn`` version of it is deprecated)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class CpuSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    process_group = None  # None: the whole world

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return super().forward(input)  # evaluation: the running statistics
        self._check_input_dim(input)

        x = input.float()  # statistics in fp32, also under bf16 autocast
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        local = torch.cat([x.sum(dims), (x * x).sum(dims), x.new_full((1,), x.numel() // max(channels, 1))])
        total = _SumAcrossRanks.apply(local, self.process_group or dist.group.WORLD)
        count = total[-1]
        mean = total[:channels] / count
        var = (total[channels:2 * channels] / count - mean * mean).clamp_min(0)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = 1.0 / self.num_batches_tracked.item() if self.momentum is None else self.momentum
                unbiased = var * count / (count - 1).clamp_min(1)
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)
        shape = (1, channels) + (1,) * (input.dim() - 2)
        out = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(input.dtype)


def convert_sync_batchnorm(module: nn.Module, device: torch.device) -> nn.Module:
    """Every BatchNorm layer of ``module`` synchronised across ranks on ``device``."""
    if device.type != "cpu":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    for layer in module.modules():
        if isinstance(layer, nn.modules.batchnorm._BatchNorm):
            layer.__class__ = CpuSyncBatchNorm  # the same state: only the forward changes
    return module

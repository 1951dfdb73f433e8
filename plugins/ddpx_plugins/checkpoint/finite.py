"""Non-finite state never saved or resumed: the checks the checkpoint plugin runs before every
save (every rank, one all_reduce) and on a checkpoint it would resume."""

from __future__ import annotations

import math

from ddpx.strategies.shards import local
from ddpx.train.stopping import across_ranks


def finite_state(trainer, state) -> bool:
    """Whether every floating tensor of the model (weights and buffers) and the
    optimizer state is finite on every rank (one all_reduce)."""
    import torch

    tensors = floating(state.get("model", {}))
    for per_param in state.get("optimizer", {}).get("state", {}).values():
        tensors += floating(per_param)
    flag = all_finite(tensors, trainer.device).to(torch.int32).reshape(1)
    if across_ranks(trainer):
        import torch.distributed as dist

        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def floating(named: dict) -> list:
    """The floating tensors of ``named`` (this rank's part of a sharded one)."""
    import torch

    return [local(t) for t in named.values() if torch.is_tensor(t) and t.is_floating_point()]


def all_finite(tensors, device):
    """A bool tensor on ``device``: no NaN or inf in ``tensors``. One max-abs pass
    per tensor (``_foreach_norm`` with ord=inf propagates NaN and cannot
    overflow), grouped by device and dtype: Adam keeps its step count on the
    CPU beside CUDA weights."""
    import torch

    groups: dict = {}
    for t in tensors:
        if t.numel():  # the inf-norm of an empty tensor is undefined
            groups.setdefault((t.device, t.dtype), []).append(t)
    flags = [torch.stack(torch._foreach_norm(group, math.inf)).isfinite().all().to(device)
             for group in groups.values()]
    return torch.stack(flags).all() if flags else torch.tensor(True, device=device)


def nonfinite_weights(checkpoint):
    """Why a checkpoint must not be resumed (non-finite weights), or None."""
    import torch

    model = checkpoint.get("replicated", {}).get("model", {})
    if bool(all_finite(floating(model), torch.device("cpu"))):
        return None
    name = next(k for k, t in model.items() if floating({k: t}) and not bool(t.isfinite().all()))
    return f"its weights are non-finite ({name})"



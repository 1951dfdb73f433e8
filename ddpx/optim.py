"""Optimizers that communicate: ``OneBitAdam``, AdamW whose momentum travels 1-bit.

A plain DDP script::

    ddp = DDP(model)
    state = ddpx.comm_hooks.register(ddp, "onebit_adam")      # exact for 100 steps, then local gradients
    opt = ddpx.optim.OneBitAdam(ddp.parameters(), comm=state, lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)

``ddpx train``: ``optimizer.target: ddpx.optim.OneBitAdam`` (AdamW's arguments); the
``comm_hook`` plugin registers the ``onebit_adam`` hook (whose descriptor names this
optimizer, ddpx/comm_hooks/onebit_adam.py) and pairs them.
"""

from __future__ import annotations

import math

import torch

from .comm_hooks.onebit_adam import OneBitAdamState
from .errors import DdpxError

__all__ = ["OneBitAdam"]


def adam_step_bound(beta1: float, beta2: float) -> float:
    """The largest |m / sqrt(v)| Adam's running sums allow (bias corrections aside):
    2.34 at betas (0.9, 0.99), 7.27 at (0.9, 0.999)."""
    if beta1 * beta1 >= beta2:
        return math.inf
    return (1 - beta1) / math.sqrt((1 - beta2) * (1 - beta1 * beta1 / beta2))


class OneBitAdam(torch.optim.AdamW):
    """1-bit Adam (Tang et al. 2021) on top of ``torch.optim.AdamW``: same arguments, same
    state (``step``, ``exp_avg``, ``exp_avg_sq``), so an AdamW checkpoint loads into it.

    While its comm hook (``comm``, an ``onebit_adam`` state: ddpx/comm_hooks/onebit_adam.py)
    warms up, the gradients are averaged exactly and this is ``AdamW.step``. Once it
    compresses, each step

    1. folds the rank's *local* gradient into the momentum (``exp_avg``),
    2. divides it by AdamW's denominator with the second moment frozen at its last
       exact value (``exp_avg_sq`` and its bias correction do not change any more),
    3. averages that update over the ranks, 1-bit with worker and server error
       feedback (``comm.average``: about 1/20 of fp32's bytes),
    4. steps with it (decoupled weight decay as AdamW's) and keeps the averaged
       momentum (the update times the denominator) as ``exp_avg``.

    Sending m / denom instead of m (DeepSpeed's 1-bit Adam sends m) is the same
    average, the denominator being frozen and identical on every rank; the update is
    what gets bounded: a coordinate that had no gradient during the warm-up has a
    frozen second moment of 0 and would step by m / eps at its first gradient, so
    each rank's update is held, elementwise, to the largest step exact Adam can take
    (``adam_step_bound``). Without that a digits MLP with 8 warm-up steps diverged
    within 3 compressed steps (pixels never lit in the warm-up), with the momentum
    sent exactly as well as 1-bit; with it, it trains.

    Gradient clipping before ``step()`` clips each rank's local gradient in the
    compressed stage (``clip_grad_norm_`` then sees the rank's own norm). A
    parameter without a gradient joins the momentum exchange with a zero gradient.
    Without ``comm`` (world size 1, or not yet paired) it is exactly AdamW.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, comm=None, **options):
        for key in ("amsgrad", "maximize", "capturable", "fused", "differentiable"):
            if options.get(key):
                raise DdpxError(f"ddpx.optim.OneBitAdam: {key}=True is not supported (its compressed stage steps "
                                f"with foreach ops on the frozen second moment); leave {key} unset")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **options)
        self.comm = None  # the onebit_adam hook state it averages through, set by pairing (comm.pair(self))
        if comm is not None:
            self.pair(comm)

    def pair(self, comm: OneBitAdamState) -> None:
        """Use ``comm`` (the ``onebit_adam`` hook state of the DDP model) for the momentum: the
        same as ``comm.pair(self)``, which sets ``self.comm``."""
        if not isinstance(comm, OneBitAdamState):
            raise DdpxError(f"ddpx.optim.OneBitAdam: comm must be the state of the 'onebit_adam' hook "
                            f"(ddpx.comm_hooks.register(ddp, 'onebit_adam')), got {comm!r}")
        comm.pair(self)

    @torch.no_grad()
    def step(self, closure=None):
        if self.comm is None or not self.comm.compressing:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params, momenta, denoms, step_sizes, bounds = [], [], [], [], []
        for group in self.param_groups:
            (beta1, beta2), lr = group["betas"], group["lr"]
            bounds += [adam_step_bound(beta1, beta2)] * len(group["params"])
            with_grad, grads, variances, corrections = [], [], [], []
            for p in group["params"]:
                state = self.state[p]
                if "exp_avg" not in state:  # first seen here: AdamW's initial state
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if "variance_step" not in state:  # the first compressed step: the second moment freezes here
                    state["variance_step"] = int(state["step"])
                state["step"] += 1
                params.append(p)
                momenta.append(state["exp_avg"])
                variances.append(state["exp_avg_sq"])
                corrections.append(math.sqrt(1 - beta2 ** max(1, state["variance_step"])))
                step_sizes.append(-lr / (1 - beta1 ** float(state["step"])))
                if p.grad is not None:
                    with_grad.append(state["exp_avg"])
                    grads.append(p.grad)
                else:
                    state["exp_avg"].mul_(beta1)
            if with_grad:
                torch._foreach_lerp_(with_grad, grads, 1 - beta1)  # AdamW's momentum update, local gradient
            if decay := group["weight_decay"]:
                torch._foreach_mul_(group["params"], 1 - lr * decay)
            # AdamW's denominator with the frozen second moment: sqrt(v / (1 - beta2^t_frozen)) + eps
            group_denoms = torch._foreach_sqrt(variances)
            torch._foreach_div_(group_denoms, corrections)
            torch._foreach_add_(group_denoms, group["eps"])
            denoms.extend(group_denoms)
        # What travels is the update m / denom, not m: the denominator is frozen and the same
        # on every rank, so averaging m / denom is averaging m, and the update is what the
        # bound below is about.
        torch._foreach_div_(momenta, denoms)
        # A coordinate with no gradient during the warm-up has a frozen second moment of 0: its
        # first gradient afterwards would step by m / eps. Exact Adam can never step further than
        # |m / sqrt(v)| <= (1 - beta1) / sqrt((1 - beta2) (1 - beta1^2 / beta2)) (Cauchy-Schwarz
        # over the two running sums): the update is held to that bound, elementwise.
        torch._foreach_clamp_min_(momenta, [-b for b in bounds])
        torch._foreach_clamp_max_(momenta, bounds)
        self.comm.average(params, momenta)
        for p, update, step_size in zip(params, momenta, step_sizes):
            p.add_(update, alpha=step_size)
        torch._foreach_mul_(momenta, denoms)  # back to the momentum, Adam's state
        return loss

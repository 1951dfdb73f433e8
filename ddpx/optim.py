"""Optimizers that communicate: ``OneBitAdam``, AdamW whose momentum travels 1-bit.

A plain DDP script::

    ddp = DDP(model)
    state = ddpx.comm_hooks.register(ddp, "onebit_adam")      # exact for 100 steps, then local gradients
    opt = ddpx.optim.OneBitAdam(ddp.parameters(), comm=state, lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)

``ddpx train``: ``optimizer.target: ddpx.optim.OneBitAdam`` (AdamW's arguments); the
``comm_hook`` plugin registers the ``onebit_adam`` hook and pairs them.
"""

from __future__ import annotations

import math

import torch

from .comm_hooks.onebit_adam import OneBitAdamState
from .errors import DdpxError

__all__ = ["OneBitAdam"]


class OneBitAdam(torch.optim.AdamW):
    """1-bit Adam (Tang et al. 2021) on top of ``torch.optim.AdamW``: same arguments, same
    state (``step``, ``exp_avg``, ``exp_avg_sq``), so an AdamW checkpoint loads into it.

    While its comm hook (``comm``, an ``onebit_adam`` state: ddpx/comm_hooks/onebit_adam.py)
    warms up, the gradients are averaged exactly and this is ``AdamW.step``. Once it
    compresses, each step

    1. folds the rank's *local* gradient into the momentum (``exp_avg``),
    2. averages the momentum over the ranks, 1-bit with worker and server error
       feedback (``comm.average_momentum``: about 1/20 of fp32's bytes),
    3. steps as AdamW with that momentum and the second moment frozen at its last
       exact value (``exp_avg_sq`` and its bias correction do not change any more).

    Gradient clipping before ``step()`` clips each rank's local gradient in the
    compressed stage (``clip_grad_norm_`` then sees the rank's own norm). A
    parameter without a gradient joins the momentum exchange with a zero gradient.
    Without ``comm`` (world size 1, or not yet paired) it is exactly AdamW.
    """

    comm_hook = "onebit_adam"  # the hook this optimizer needs (ddpx train registers it)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, comm=None, **options):
        for key in ("amsgrad", "maximize", "capturable", "fused", "differentiable"):
            if options.get(key):
                raise DdpxError(f"ddpx.optim.OneBitAdam: {key}=True is not supported (its compressed stage steps "
                                f"with foreach ops on the frozen second moment); leave {key} unset")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **options)
        self.comm = None
        if comm is not None:
            self.pair(comm)

    def pair(self, comm: OneBitAdamState) -> None:
        """Use ``comm`` (the ``onebit_adam`` hook state of the DDP model) for the momentum."""
        if not isinstance(comm, OneBitAdamState):
            raise DdpxError(f"ddpx.optim.OneBitAdam: comm must be the state of the 'onebit_adam' hook "
                            f"(ddpx.comm_hooks.register(ddp, 'onebit_adam')), got {comm!r}")
        self.comm = comm

    @torch.no_grad()
    def step(self, closure=None):
        if self.comm is None or not self.comm.compressing:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params, momenta = [], []
        for group in self.param_groups:
            beta1 = group["betas"][0]
            with_grad, grads = [], []
            for p in group["params"]:
                state = self.state[p]
                if "exp_avg" not in state:  # first seen here: AdamW's initial state
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if "variance_step" not in state:  # the first compressed step: freeze here
                    state["variance_step"] = int(state["step"])
                params.append(p)
                momenta.append(state["exp_avg"])
                if p.grad is not None:
                    with_grad.append(state["exp_avg"])
                    grads.append(p.grad)
                else:
                    state["exp_avg"].mul_(beta1)
            if with_grad:
                torch._foreach_lerp_(with_grad, grads, 1 - beta1)  # AdamW's momentum update, local gradient
        self.comm.average_momentum(params, momenta)
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            ps = group["params"]
            if not ps:
                continue
            states = [self.state[p] for p in ps]
            for state in states:
                state["step"] += 1
            if decay:
                torch._foreach_mul_(ps, 1 - lr * decay)
            # AdamW's update with the frozen second moment and its frozen bias correction
            denom = torch._foreach_sqrt([s["exp_avg_sq"] for s in states])
            torch._foreach_div_(denom, [math.sqrt(1 - beta2 ** s["variance_step"]) for s in states])
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(ps, [s["exp_avg"] for s in states], denom,
                                    [-lr / (1 - beta1 ** float(s["step"])) for s in states])
        return loss

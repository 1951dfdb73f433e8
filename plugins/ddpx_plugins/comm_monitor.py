"""A one-time warning when gradient communication takes a large share of each step.

Occasionally (not every step) the plugin times a window of ``window_steps``
optimizer steps, then all ranks run one timed fp32 allreduce of a buffer the
size of the gradients (scaled by the comm hook's compression, when one is
installed). The communication share is that allreduce time over the mean step
time. Above ``threshold``, rank 0 warns once, naming the options: gradient
accumulation or a larger batch (communicate less often), a compressing comm
hook, and ``ddpx bench comm`` to measure which helps.

Cost: between measurements, nothing (the windows are scheduled with
``trainer.call_at_step``). A
measurement is four allreduces of the gradient size (a warm-up and the fastest
of three timed) plus a device synchronisation at both ends of the window, first at step
``start_step`` after the start (or resume) and then every ``every_steps``.
Every rank measures at the same steps, so the collectives line up.

Config section ``comm_monitor``: ``enabled`` (true), ``threshold`` (0.5, the
share of a step), ``start_step`` (20), ``window_steps`` (10), ``every_steps``
(1000).
"""

from __future__ import annotations

import time

from ddpx import hookimpl
from ddpx.errors import DdpxError
from ddpx.plugin.shared import ACCUMULATION_STEPS, COMM_HOOK


class CommMonitor:
    def __init__(self, cfg):
        self.cfg = cfg
        self.window_start = None  # (global step, perf_counter) of the open window
        self.warned = False
        self.shares: list[float] = []  # every measured share, for tests and curious users
        from ddpx.net import measure_allreduce_seconds  # imported here, not inside a timed window

        self.measure_allreduce_seconds = measure_allreduce_seconds

    def open_window(self, trainer):
        _sync(trainer)
        self.window_start = (trainer.global_step, time.perf_counter())
        trainer.call_at_step(trainer.global_step + self.cfg["window_steps"], self.close_window)

    def close_window(self, trainer):
        _sync(trainer)
        first, started = self.window_start
        step = trainer.global_step
        step_s = (time.perf_counter() - started) / (step - first)
        self.window_start = None
        trainer.call_at_step(step + self.cfg["every_steps"], self.open_window)
        share, comm_s, grad_bytes = measure_share(trainer, step_s, self.measure_allreduce_seconds)
        self.shares.append(share)
        if share > self.cfg["threshold"] and not self.warned:
            self.warned = True
            if trainer.is_main:
                trainer.log.warning(warning_text(trainer, share, comm_s, step_s, grad_bytes))


def _sync(trainer):
    import torch

    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)


class CommMonitorPlugin:
    """``state``: the run's :class:`CommMonitor`, or None (disabled, or one rank)."""

    def __init__(self):
        self.state = None

    @hookimpl
    def ddpx_config_defaults(self):
        return {"comm_monitor": {"enabled": True, "threshold": 0.5, "start_step": 20, "window_steps": 10,
                                 "every_steps": 1000}}

    @hookimpl
    def ddpx_configure(self, config):
        cfg = config.section("comm_monitor")
        if not 0.0 <= cfg["threshold"] <= 1.0:
            raise DdpxError(f"comm_monitor.threshold is a share of a step between 0 and 1, got {cfg['threshold']}")
        for key in ("start_step", "window_steps", "every_steps"):
            if cfg[key] < 1:
                raise DdpxError(f"comm_monitor.{key} must be at least 1, got {cfg[key]}")

    @hookimpl
    def ddpx_setup(self, trainer):
        cfg = trainer.config.section("comm_monitor")
        self.state = CommMonitor(cfg) if cfg["enabled"] and trainer.world_size > 1 else None

    @hookimpl
    def ddpx_train_start(self, trainer):
        if self.state is not None:  # every rank: the measurement's collectives line up
            trainer.call_at_step(trainer.global_step + self.state.cfg["start_step"], self.state.open_window)


def measure_share(trainer, step_s, measure_allreduce_seconds):
    """(share of a step, communication seconds, gradient bytes): every rank, same collectives."""
    grad_bytes = sum(p.numel() * p.element_size() for p in trainer.module.parameters() if p.requires_grad)
    if not trainer.strategy.replicated:  # ranks hold different parts (a pipeline's stages): one size for all,
        grad_bytes = _largest(grad_bytes, trainer.device)  # or the timed allreduce's buffers do not match
    # the fastest of 3: what the link needs, without another process's burst on a shared CPU
    comm_s = measure_allreduce_seconds(grad_bytes, iters=3, device=trainer.device, fastest=True)
    hook = trainer.shared.get(COMM_HOOK)
    stats = hook.stats() if hook is not None else None
    if stats and stats.get("wire_bytes") and stats.get("fp32_wire_bytes"):
        comm_s *= min(1.0, stats["wire_bytes"] / stats["fp32_wire_bytes"])  # what the hook sends of fp32's bytes
    return min(1.0, comm_s / step_s) if step_s > 0 else 0.0, comm_s, grad_bytes


def _largest(value: int, device) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def warning_text(trainer, share, comm_s, step_s, grad_bytes):
    from ddpx.net import accumulation_advice

    batch = trainer.config.trainer.batch_size
    accumulation = trainer.shared.get(ACCUMULATION_STEPS, 1)
    # the step minus the allreduce: compute, where DDP did not hide the allreduce behind the backward pass
    k = accumulation_advice(comm_s, step_s - comm_s, accumulation)
    hook = trainer.shared[COMM_HOOK].name if COMM_HOOK in trainer.shared else "allreduce"
    compress = trainer.strategy.compression_advice
    unknown = "" if comm_s < step_s else (
        "; the allreduce alone measured longer than the whole step (DDP overlaps it with the backward pass), "
        "so the step does not tell how long compute takes")
    if k is not None:
        less_often = f"accumulation.steps={k} or a larger trainer.batch_size (now {batch} per rank)"
    else:
        less_often = (f"a larger accumulation.steps (now {accumulation}) or trainer.batch_size (now {batch} per "
                      "rank)")
    return (
        f"communication takes about {100 * share:.0f}% of each optimizer step (gradient allreduce of "
        f"{grad_bytes / 1e6:.1f} MB: {1e3 * comm_s:.1f} ms of a {1e3 * step_s:.1f} ms step"
        f"{', comm hook ' + hook if hook != 'allreduce' else ''}{unknown}). Options: communicate less often with "
        f"{less_often}; {compress}; `ddpx bench comm CONFIG` measures which helps. "
        "(warned once; comm_monitor.enabled=false silences it)"
    )

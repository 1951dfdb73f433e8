"""Gradient accumulation: one optimizer step every ``steps`` micro-batches.

Micro-batches are grouped into windows of ``steps``; the last micro-batch of a
window steps the optimizer, and the last micro-batch of the epoch always does,
so an epoch whose length is not a multiple of ``steps`` ends with a shorter
window instead of leaking gradients into the next epoch. The micro-batches that
do not step run forward and backward inside ``model.no_sync()`` (no gradient
all-reduce; DDP communicates once per window). The back-propagated loss is
divided by the size of the current window, so the accumulated gradient is the
mean over the window's micro-batches -- the gradient of one big batch -- also
for a short final window. The loss reported to other plugins is the unscaled
micro-batch loss. The core steps the LR scheduler once per optimizer step.

Config section ``accumulation``: ``steps`` (1: no accumulation).

Per-run state lives in ``trainer.accumulation`` (an :class:`AccumulationState`),
the per-step hooks in :class:`AccumulationSteps`, attached (plugin
``accumulation.steps``) only when ``steps`` > 1: without accumulation the
plugin costs nothing per step (docs/plugins.md, "Per-run state").
"""

import contextlib

from ddpx import hookimpl
from ddpx.errors import DdpxError
from ddpx.plugin import attach


class AccumulationState:
    """What one run of the plugin holds (``trainer.accumulation``)."""

    def __init__(self, steps):
        self.steps = steps
        self.window = 1  # micro-batches in the current window (the loss divisor)


@hookimpl
def ddpx_config_defaults():
    return {"accumulation": {"steps": 1}}


@hookimpl
def ddpx_configure(config):
    steps = config.section("accumulation")["steps"]
    if steps < 1:
        raise DdpxError(f"accumulation.steps must be at least 1 (got {steps})")


@hookimpl
def ddpx_setup(trainer):
    trainer.accumulation = AccumulationState(trainer.config.section("accumulation")["steps"])
    if trainer.accumulation.steps > 1:  # steps 1: every micro-batch steps, nothing to do per step
        attach(trainer.plugin_manager, AccumulationSteps(trainer.accumulation), "accumulation.steps")


class AccumulationSteps:
    """The per-step hooks (attached only when ``steps`` > 1)."""

    def __init__(self, acc):
        self.acc = acc

    @hookimpl
    def ddpx_should_step(self, trainer, batch_index, num_batches):
        """The window rule: the last micro-batch of a window of ``steps`` (or of the epoch) steps."""
        acc = self.acc
        start = batch_index - batch_index % acc.steps
        end = start + acc.steps if num_batches is None else min(start + acc.steps, num_batches)
        acc.window = end - start
        return batch_index + 1 >= end

    @hookimpl(wrapper=True)
    def ddpx_micro_step(self, trainer, batch, sync):
        no_sync = getattr(trainer.model, "no_sync", None)
        context = no_sync() if not sync and no_sync is not None else contextlib.nullcontext()
        with context:
            loss = yield
        window = self.acc.window
        return loss if window == 1 else loss * window  # report the micro-batch's own loss

    @hookimpl(wrapper=True)
    def ddpx_forward(self, trainer, batch):
        loss = yield
        window = self.acc.window
        return loss if window == 1 else loss / window

"""Gradient accumulation: one optimizer step every ``steps`` micro-batches.

Micro-batches are grouped into windows of ``steps`` (``ddpx_step_window``); the
trainer runs all but the last of a window inside ``model.no_sync()`` (DDP
communicates once per window) and divides each back-propagated loss by the
window's size, so the accumulated gradient is the mean over the window, the
gradient of one big batch. The last window of an epoch is shorter when the epoch
does not divide, instead of leaking gradients into the next epoch. Logged
losses are the micro-batches' own; the trainer steps the LR scheduler once per
optimizer step.

Config section ``accumulation``: ``steps`` (1: no accumulation).
"""

from ddpx import hookimpl
from ddpx.errors import DdpxError
from ddpx.plugin.shared import ACCUMULATION_STEPS


class AccumulationPlugin:
    """``steps``: micro-batches per optimizer step in this run (shared as ``ACCUMULATION_STEPS``)."""

    def __init__(self):
        self.steps = 1

    @hookimpl
    def ddpx_config_defaults(self):
        return {"accumulation": {"steps": 1}}

    @hookimpl
    def ddpx_configure(self, config):
        steps = config.section("accumulation")["steps"]
        if steps < 1:
            raise DdpxError(f"accumulation.steps must be at least 1 (got {steps})")

    @hookimpl
    def ddpx_setup(self, trainer):
        self.steps = trainer.shared[ACCUMULATION_STEPS] = trainer.config.section("accumulation")["steps"]

    @hookimpl
    def ddpx_step_window(self, trainer, batch_index, num_batches):
        return min(self.steps, num_batches - batch_index)  # the epoch's last window may be shorter

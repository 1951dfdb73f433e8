"""Shims for the per-step hooks that ddpx 0.2 replaced, kept for one release.

A plugin that still implements one of them keeps working; the run warns once
per hook with the replacement (docs/plugins.md, "Migrating from the per-step
hooks"):

* ``ddpx_should_step(batch_index, num_batches)``: asked micro-batch by
  micro-batch, it decides the window (``ddpx_step_window``);
* ``ddpx_micro_step(batch, sync)`` wrappers: they surround each micro-batch's
  forward and backward, as before;
* ``ddpx_backward(loss)``: called instead of the core's backward; None lets the
  core back-propagate.

Nothing here runs when no plugin implements them.
"""

from __future__ import annotations

import logging

from ..plugin.manager import attach
from ..plugin.markers import hookimpl

REPLACED = {
    "ddpx_should_step": "implement ddpx_step_window(trainer, batch_index, num_batches) returning the number of "
                        "micro-batches of the optimizer step",
    "ddpx_micro_step": "wrap ddpx_forward instead (the core runs all but the last micro-batch of a window under "
                       "no_sync itself)",
    "ddpx_backward": "return a GradScaler from ddpx_grad_scaler instead (the core back-propagates "
                     "scaler.scale(loss))",
}
_warned: set = set()  # (plugin, hook): once per process


def install_legacy_step_hooks(trainer) -> None:
    """Attach the shims for the replaced hooks some plugin still implements, warning once each."""
    pm = trainer.plugin_manager
    used = {}
    for name in REPLACED:
        plugins = [impl.plugin_name for impl in getattr(pm.hook, name).get_hookimpls()
                   if not impl.plugin_name.startswith("legacy.")]
        if plugins:
            used[name] = plugins
    for name, plugins in used.items():
        for plugin in plugins:
            if (plugin, name) not in _warned and trainer.rank == 0:  # the same on every rank: said once
                _warned.add((plugin, name))
                logging.getLogger("ddpx").warning(
                    f"plugin '{plugin}' implements {name}, replaced in ddpx 0.2 and removed in 0.3: {REPLACED[name]}")
    if "ddpx_should_step" in used:
        attach(pm, ShouldStepWindow(), "legacy.should_step")
    if "ddpx_micro_step" in used or "ddpx_backward" in used:
        shim = MicroStepShim(trainer)
        attach(pm, shim, "legacy.micro_step")
        # per-run instance attributes over the methods: the trainer object is the run's
        trainer.forward_backward = shim.forward_backward
        trainer.backward = shim.backward


class ShouldStepWindow:
    """``ddpx_step_window`` from ``ddpx_should_step``: up to the first micro-batch that steps."""

    @hookimpl(tryfirst=True)
    def ddpx_step_window(self, trainer, batch_index, num_batches):
        window = 1
        while batch_index + window < num_batches:
            steps = trainer.hook.ddpx_should_step(trainer=trainer, batch_index=batch_index + window - 1,
                                                  num_batches=num_batches)
            if steps is None or steps:  # None: no answer, and the old default stepped
                break
            window += 1
        return window


class MicroStepShim:
    """Runs each micro-batch inside the ``ddpx_micro_step`` wrappers, and lets a
    ``ddpx_backward`` implementation back-propagate."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.core_forward_backward = trainer.forward_backward  # the bound methods of the class
        self.core_backward = trainer.backward
        self.window = 1
        self.done = 0  # micro-batches of the running window already run

    def forward_backward(self, batch, window):
        self.window = window
        self.done += 1
        sync = self.done == window  # as in 0.1: the window's last micro-batch, after which the optimizer steps
        if sync:
            self.done = 0
        return self.trainer.hook.ddpx_micro_step(trainer=self.trainer, batch=batch, sync=sync)

    @hookimpl(trylast=True)
    def ddpx_micro_step(self, trainer, batch, sync):  # the body the old wrappers surround
        return self.core_forward_backward(batch, self.window)

    def backward(self, loss):
        if not self.trainer.hook.ddpx_backward(trainer=self.trainer, loss=loss):
            self.core_backward(loss)

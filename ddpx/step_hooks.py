"""The per-step hooks as the training loop calls them.

pluggy's dispatch costs about a microsecond per call, and the loop makes five
step-hook calls per micro-batch. :func:`step_callers` resolves, once per
epoch, what each call should be:

* a hook that only the core implements is called as the core's bound method
  (no dispatch);
* a hook some plugin implements (AMP's backward, accumulation's should-step),
  and every hook while tracing (``plugins.trace``), goes through pluggy;
* ``ddpx_batch_end`` is None when no plugin implements it (the default
  configuration: the built-in plugins schedule their occasional work with
  ``trainer.call_at_step`` instead), so the loop skips it.

Every callable takes the hookspec's arguments as keywords, as pluggy does.
"""

from __future__ import annotations

from typing import Any, Optional

import pluggy

from .plugin import CORE_PLUGIN

STEP_HOOKS = ("ddpx_should_step", "ddpx_micro_step", "ddpx_forward", "ddpx_backward", "ddpx_optimizer_step")


def step_callers(pm: pluggy.PluginManager) -> dict[str, Optional[Any]]:
    """``{hook name: callable}`` for the step hooks and ``ddpx_batch_end`` (None
    when nothing implements it). Resolve again after plugins attach or detach."""
    core = pm.get_plugin(CORE_PLUGIN)
    tracing = getattr(pm, "ddpx_tracing", False)
    callers: dict[str, Optional[Any]] = {}
    for name in STEP_HOOKS:
        caller = getattr(pm.hook, name)
        impls = caller.get_hookimpls()
        only_core = len(impls) == 1 and impls[0].plugin is core
        callers[name] = getattr(core, name) if only_core and not tracing else caller
    batch_end = pm.hook.ddpx_batch_end
    callers["ddpx_batch_end"] = batch_end if batch_end.get_hookimpls() else None
    return callers

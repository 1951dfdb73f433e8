"""What a checkpoint holds of a run (``Trainer.state_dict`` / ``Trainer.load_state_dict``): the
trainer's own entries, each plugin object's state under its name, and module plugins' entries."""

from __future__ import annotations

from ..errors import DdpxError
from ..plugin.manager import stateful_plugins

TRAINER_STATE = ("model", "optimizer", "scheduler", "progress")  # the trainer's own entries in a checkpoint


def run_state(trainer) -> dict:
    """The trainer's ``model``, ``optimizer`` (as the strategy holds them), ``scheduler`` and
    ``progress``; each plugin object's ``state_dict()`` filed under the plugin's name
    (:func:`ddpx.plugin.manager.stateful_plugins`; None files nothing); and the entries of module
    plugins' ``ddpx_state_dict`` hooks."""
    progress = {
        # The epoch to resume in: the next one once this epoch's batches are done.
        "epoch": trainer.epoch + (1 if trainer.epoch_finished else 0),
        "global_step": trainer.global_step,
    }
    model, optimizer = trainer.strategy.model_state(trainer.module, trainer.optimizer)
    state = {"model": model, "optimizer": optimizer, "progress": progress}
    if trainer.scheduler is not None:
        state["scheduler"] = trainer.scheduler.state_dict()
    for name, plugin in stateful_plugins(trainer.plugin_manager):
        if name in TRAINER_STATE:
            raise DdpxError(f"plugin '{name}' cannot keep state under its name: {name!r} is the trainer's; "
                            "rename the plugin")
        part = plugin.state_dict(trainer)
        if part is not None:
            state[name] = part
    for part in reversed(trainer.hook.ddpx_state_dict(trainer=trainer)):  # registration order
        if part:
            state.update(part)
    return state


def load_run_state(trainer, state: dict) -> None:
    """Restore what :func:`run_state` holds: a plugin object gets the entry filed under its name;
    module plugins get the whole ``state`` through ``ddpx_load_state_dict``."""
    trainer.strategy.load_model_state(trainer.module, trainer.optimizer, state.get("model"), state.get("optimizer"))
    if "scheduler" in state and trainer.scheduler is not None:
        trainer.scheduler.load_state_dict(state["scheduler"])
    if "progress" in state:
        trainer.epoch = int(state["progress"]["epoch"])
        trainer.global_step = int(state["progress"]["global_step"])
    for name, plugin in stateful_plugins(trainer.plugin_manager):
        part = state.get(name)
        if part is not None:
            plugin.load_state_dict(trainer, part)
    trainer.hook.ddpx_load_state_dict(trainer=trainer, state=state)

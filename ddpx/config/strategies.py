"""What ``trainer.strategy`` names: a built-in strategy (``ddp``, ``fsdp``), one an installed
package registers in the entry-point group ``ddpx.strategies``, or an import path
``package.module:Class`` (a module beside the config file is found as the model's is).

The config resolves it, as it resolves ``model.target``: a name that is none of these is one
line in the launcher, and the strategy's own config sections (``config_defaults``) and checks
(``check_config``) join the validation. The built-in ones are named by import path, like the
trainer's default hooks: they sit above the config (ddpx/strategies/), so this module does
not import them.
"""

from __future__ import annotations

import importlib.metadata

from ..errors import DdpxError, did_you_mean
from ..imports import resolve

BUILTIN_STRATEGIES = {"ddp": "ddpx.strategies.ddp:DDPStrategy", "fsdp": "ddpx.strategies.fsdp:FSDPStrategy",
                      "pipeline": "ddpx.strategies.pipeline:PipelineStrategy",
                      "tensor": "ddpx.strategies.tensor:TensorStrategy"}
ENTRY_POINT_GROUP = "ddpx.strategies"
BASE = ("ddpx.strategies.base", "Strategy")


def installed_strategies() -> dict:
    """``{name: entry point}`` of the strategies installed packages register."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def check_strategy_name(name) -> None:
    """A one-line error for a ``trainer.strategy`` that names no strategy, without importing one
    (nor torch): a misspelt name fails before anything heavy loads."""
    if not isinstance(name, str) or not name:
        raise DdpxError(f"config key 'trainer.strategy' must name a strategy (ddp, fsdp, pipeline, tensor, an installed one or an "
                        f"import path package.module:Class), got {name!r}")
    if name in BUILTIN_STRATEGIES or "." in name or ":" in name:  # no scan of the installed distributions for these
        return
    installed = installed_strategies()
    if name not in installed:
        names = [*BUILTIN_STRATEGIES, *sorted(installed)]
        raise DdpxError(f"unknown trainer.strategy '{name}'{did_you_mean(name, names)}; choose one of "
                        f"{', '.join(names)}, or give an import path package.module:Class")


def strategy_sections(name: str) -> dict:
    """The config sections strategy ``name`` declares (its ``config_defaults``). The built-in ones
    declare none (their section, ``fsdp``, is ddpx's own: schema.py), so they are not imported
    for it, nor is torch."""
    return {} if name in BUILTIN_STRATEGIES else dict(strategy_class(name).config_defaults)


def strategy_import_path(name: str) -> str:
    """``module.Class`` of strategy ``name``; a built-in one is not imported for it (nor torch)."""
    if name in BUILTIN_STRATEGIES:
        return BUILTIN_STRATEGIES[name].replace(":", ".")
    cls = strategy_class(name)
    return f"{cls.__module__}.{cls.__qualname__}"


LIVE_STRATEGIES = {"ddp": "ddpx.strategies.live:LiveDDPStrategy"}  # elastic.recovery: live


def run_strategy_class(config) -> type:
    """The strategy class of a run: ``trainer.strategy``'s, or under ``elastic.recovery: live`` its
    live form (ddp only, so far)."""
    name = config.trainer.strategy
    if getattr(getattr(config, "elastic", None), "recovery", "restart") != "live":  # a config made by hand may lack it
        return strategy_class(name)
    if name not in LIVE_STRATEGIES:
        raise DdpxError(f"elastic.recovery=live supports trainer.strategy={', '.join(LIVE_STRATEGIES)}, not {name}; "
                        "use elastic.recovery=restart with it (a failure restarts every rank from the last checkpoint)")
    return resolve(LIVE_STRATEGIES[name], "elastic.recovery=live")


def strategy_class(name: str) -> type:
    """The strategy class ``trainer.strategy`` names (see the module docstring)."""
    check_strategy_name(name)
    if name in BUILTIN_STRATEGIES:
        found = resolve(BUILTIN_STRATEGIES[name], f"built-in strategy '{name}'")
    elif name in (installed := installed_strategies()):
        ep = installed[name]
        try:
            found = ep.load()
        except Exception as exc:
            raise DdpxError(f"trainer.strategy '{name}' (entry point {ep.value}) failed to import: "
                            f"{type(exc).__name__}: {exc}") from None
    else:  # an import path
        found = resolve(name, "trainer.strategy")
    if not isinstance(found, type) or not any((c.__module__, c.__qualname__) == BASE for c in found.__mro__):
        raise DdpxError(f"trainer.strategy '{name}' is {found!r}, not a strategy: subclass "
                        "ddpx.strategies.Strategy (docs/strategies.md)")
    return found

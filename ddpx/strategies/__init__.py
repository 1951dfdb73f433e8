"""Strategies: how a run splits its work over the ranks, one object per run.

``trainer.strategy`` names one (ddpx/config/strategies.py): ``ddp`` (the default: the
model replicated, gradients averaged by ``DistributedDataParallel``), ``fsdp`` (the
model sharded by FSDP2), one an installed package registers in the entry-point group
``ddpx.strategies``, or an import path ``package.module:Class``. The trainer and the
built-in plugins ask the run's strategy (``trainer.strategy``) whatever differs between
them (:mod:`.base` lists the questions); none asks which strategy runs.

* :mod:`.base`: :class:`Strategy`, the contract and the defaults of a replicated model;
* :mod:`.ddp`, :mod:`.fsdp`: the built-in strategies;
* :mod:`.shards`: DTensors and their checkpoint files, for any strategy with sharded state.
"""

from __future__ import annotations

from ..config.strategies import run_strategy_class
from .base import PartReduction, Strategy

__all__ = ["Strategy", "PartReduction", "make"]


def make(config) -> Strategy:
    """The run's strategy, as ``config``'s ``trainer.strategy`` names it (its live form under
    ``elastic.recovery: live``)."""
    return run_strategy_class(config)(config)

"""What every rank must agree on at an epoch's start and end (``trainer.check_collectives``):
the collectives issued, the skipped optimizer steps, the batches of the epoch, the step, and
what the strategy says the replicas share (ddp: the sum of the weights)."""

from __future__ import annotations

import sys

UNCOUNTED = sys.maxsize  # num_batches of an epoch over a loader without __len__: it ends where its data does


def check_ranks_agree(trainer, watchdog, at_start: bool) -> None:
    """At an epoch's start and end: every rank issued the same collectives and skipped the same
    optimizer steps; at the start, every rank has as many batches (a loader without ``__len__`` has
    no count to compare); at the end, the step and the strategy's replica checks are the same. Else
    :class:`~ddpx.errors.RanksDisagree` on every rank, before the disagreement hangs a collective,
    crashes gloo or is saved. One small all_reduce (``watchdog.agree``)."""
    counters = {"skipped optimizer steps": trainer.skipped_steps}
    if at_start:
        if trainer.num_batches != UNCOUNTED:  # a stream without __len__: its end is agreed, checked at the end
            counters["batches in this epoch"] = trainer.num_batches
    else:
        counters["optimizer steps"] = trainer.global_step
    checks = {} if at_start else trainer.strategy.replica_checks(trainer.module)  # what the replicas share
    sums = {what: value for what, (value, _) in checks.items()}
    watchdog.agree(counters, sums=sums,
                   hints=lambda: {**_hints(trainer), **{what: hint for what, (_, hint) in checks.items()}})


def _hints(trainer) -> dict:
    """What to do about each count compared (made only when ranks differ)."""
    impls = trainer.plugin_manager.hook.ddpx_optimizer_step.get_hookimpls()
    stepping = ", ".join(i.plugin_name for i in reversed(impls))
    return {
        "skipped optimizer steps": f": a ddpx_optimizer_step hook (plugins: {stepping}) returned False on some "
                                   "ranks only, so their weights differ now; decide from values every rank "
                                   "shares (all-reduced ones)",
        "optimizer steps": ": every rank must end the epoch after the same step (a loader that ran out early "
                           "on some ranks; a stream without __len__ ends where the ranks agree)",
        "batches in this epoch": ": every rank must take the same number of steps; give every rank the "
                                 "same number of batches (a sampler that splits the data evenly, e.g. "
                                 "DistributedSampler, which pads, or drop_last)",
    }

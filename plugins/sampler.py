"""Shard the data across ranks; reshuffle every epoch; remember the position.

The training set is read through a
:class:`~ddpx.data.sampler.ResumableDistributedBatchSampler` (each rank gets a
disjoint part of every global batch; all ranks agree on the epoch's shuffle).
This plugin calls ``set_epoch(epoch)`` at every epoch start, so a user cannot
forget it, and advances the position only when a batch has been trained on, so
a checkpoint (key ``"sampler"``) resumes exactly after the last trained batch,
even with a different number of ranks. Evaluation data is split into
contiguous shards without padding, so no sample is counted twice.

Config section ``sampler``: ``shuffle`` (true), ``drop_last`` (false: the short
tail of an epoch is divided across ranks instead of dropped). The loaders use
``trainer.batch_size`` (per rank), ``trainer.eval_batch_size``,
``trainer.num_workers``; memory is pinned when training on CUDA.
"""

from ddpx import hookimpl
from ddpx.plugin import attach


@hookimpl
def ddpx_config_defaults():
    return {"sampler": {"shuffle": True, "drop_last": False}}


@hookimpl
def ddpx_build_dataloaders(trainer, train_set, eval_set):
    from torch.utils.data import DataLoader

    from ddpx.data.sampler import ResumableDistributedBatchSampler, ShardSampler

    cfg = trainer.config.section("sampler")
    settings = trainer.config.trainer
    batch_sampler = ResumableDistributedBatchSampler(
        len(train_set),
        settings.batch_size,
        trainer.rank,
        trainer.world_size,
        shuffle=cfg["shuffle"],
        seed=trainer.config.seed,
        drop_last=cfg["drop_last"],
    )
    loader_options = {
        "num_workers": settings.num_workers,
        "pin_memory": trainer.device.type == "cuda",
        "persistent_workers": settings.num_workers > 0,
    }
    train_loader = DataLoader(train_set, batch_sampler=batch_sampler, **loader_options)
    eval_loader = None
    if eval_set is not None:
        eval_loader = DataLoader(
            eval_set,
            batch_size=settings.eval_batch_size,
            sampler=ShardSampler(len(eval_set), trainer.rank, trainer.world_size),
            **loader_options,
        )
    return train_loader, eval_loader


def _batch_sampler(trainer):
    """The training loader's resumable sampler, or None if another plugin built the loader."""
    from ddpx.data.sampler import ResumableDistributedBatchSampler

    sampler = getattr(getattr(trainer, "train_loader", None), "batch_sampler", None)
    return sampler if isinstance(sampler, ResumableDistributedBatchSampler) else None


@hookimpl(tryfirst=True)  # before anything reads len(train_loader) for this epoch
def ddpx_epoch_start(trainer, epoch):
    sampler = _batch_sampler(trainer)
    if sampler is None:
        return
    sampler.set_epoch(epoch)
    pm = trainer.plugin_manager
    attached = pm.get_plugin(STEPS)
    if attached is None or attached.sampler is not sampler:  # found once: no lookup per step
        attach(pm, SamplerSteps(sampler), STEPS)


STEPS = "sampler.steps"


class SamplerSteps:
    """The per-step hook: advance the position once the batch is trained on."""

    def __init__(self, sampler):
        self.sampler = sampler

    @hookimpl
    def ddpx_batch_end(self, trainer, batch_index, loss, stepped):
        self.sampler.advance()


@hookimpl
def ddpx_state_dict(trainer):
    sampler = _batch_sampler(trainer)
    return None if sampler is None else {"sampler": sampler.state_dict()}


@hookimpl
def ddpx_load_state_dict(trainer, state):
    sampler = _batch_sampler(trainer)
    if sampler is not None and "sampler" in state:
        sampler.load_state_dict(state["sampler"])

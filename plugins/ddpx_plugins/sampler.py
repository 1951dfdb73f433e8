"""Shard the data across ranks; reshuffle every epoch; remember the position.

The training set is read through a
:class:`~ddpx.data.sampler.ResumableDistributedBatchSampler` (each rank gets a
disjoint part of every global batch; all ranks agree on the epoch's shuffle).
This plugin calls ``set_epoch(epoch)`` at every epoch start, so a user cannot
forget it. The position counts only batches trained on (not those the loader
prefetched): it is brought up to ``trainer.epoch_batches`` when a checkpoint
reads it, not every step, so a checkpoint (key ``"sampler"``) resumes exactly
after the last trained batch, even with a different number of ranks. Evaluation data is split into
contiguous shards without padding, so no sample is counted twice.

Config section ``sampler``: ``shuffle`` (true), ``drop_last`` (false: the short
tail of an epoch is divided across ranks instead of dropped). The loaders use
``trainer.batch_size`` (per rank), ``trainer.eval_batch_size``,
``trainer.num_workers``; memory is pinned when training on CUDA.

Per-run state lives in ``trainer.sampler`` (a :class:`SamplerState`; docs/plugins.md, "Per-run state").
"""

from ddpx import hookimpl


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


class SamplerState:
    """What one run of the plugin holds (``trainer.sampler``)."""

    def __init__(self):
        self.synced = 0  # batches of trainer.epoch_batches already in the sampler's position


@hookimpl
def ddpx_setup(trainer):
    trainer.sampler = SamplerState()


@hookimpl(tryfirst=True)  # before anything reads len(train_loader) for this epoch
def ddpx_epoch_start(trainer, epoch):
    sampler = _batch_sampler(trainer)
    if sampler is None:
        return
    sampler.set_epoch(epoch)  # the same epoch again (a resumed run) keeps the position
    trainer.sampler.synced = 0


def synced_sampler(trainer):
    """The training sampler, its position advanced over the batches trained since
    the last call (or None if another plugin built the loader)."""
    sampler = _batch_sampler(trainer)
    if sampler is None:
        return None
    state, done = trainer.sampler, trainer.epoch_batches
    behind = done - state.synced
    if behind > 0:
        sampler.advance(behind)
        state.synced = done
    return sampler


@hookimpl
def ddpx_state_dict(trainer):
    sampler = synced_sampler(trainer)
    return None if sampler is None else {"sampler": sampler.state_dict()}


@hookimpl
def ddpx_load_state_dict(trainer, state):
    sampler = _batch_sampler(trainer)
    if sampler is not None and "sampler" in state:
        sampler.load_state_dict(state["sampler"])

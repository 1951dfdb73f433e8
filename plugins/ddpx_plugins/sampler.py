"""Shard the data across ranks; reshuffle every epoch; remember the position.

The training set is read through a
:class:`~ddpx.data.sampler.ResumableDistributedBatchSampler` (each rank gets a
disjoint part of every global batch; all ranks agree on the epoch's shuffle).
This plugin calls ``set_epoch(epoch)`` at every epoch start, so a user cannot
forget it. The position counts only batches trained on (not those the loader
prefetched): it is brought up to ``trainer.epoch_batches`` when a checkpoint
reads it, not every step, so a checkpoint (key ``"sampler"``) resumes exactly
after the last trained batch, even with a different number of ranks. Evaluation data is split into
contiguous shards without padding, so no sample is counted twice. An
``IterableDataset`` is sharded, told the epoch (``set_epoch``) and resumed by
:mod:`ddpx.data.stream` instead (with or without ``__len__``).

Config section ``sampler``: ``shuffle`` (true), ``drop_last`` (false: the short
tail of an epoch is divided across ranks instead of dropped). The training
loader reads the set through :class:`~ddpx.data.seeded.SeededDataset`
(DataLoader workers seeded from ``(seed, rank, worker, epoch)``, or each sample
from ``(seed, epoch, index)`` with ``trainer.seed_per_sample``). The loaders use
``trainer.batch_size`` (per rank), ``trainer.eval_batch_size``,
``trainer.num_workers``; memory is pinned when training on CUDA.

The plugin is one :class:`SamplerPlugin` object holding the run's position (docs/plugins.md, "Per-run state").
"""

from ddpx import hookimpl
from ddpx.errors import DdpxError


def _collate(target):
    from ddpx.data.collate import Collate
    from ddpx.imports import resolve

    return Collate(target, resolve(target, "data.collate") if target else None)


def _stream_loader(trainer, train_set, loader_options, generator):
    """An IterableDataset: sharded across ranks and workers (ddpx/data/stream.py). With ``__len__``,
    the same steps on every rank; without, the epoch ends where the data does (the trainer agrees on it)."""
    from torch.utils.data import DataLoader

    from ddpx.data.stream import (CountedStreamLoader, ShardedStream, StreamLoader, batches_per_rank,
                                  check_worker_split, has_length)

    settings, target = trainer.config.trainer, trainer.config.data.target
    replica, replicas = trainer.strategy.data_parallel(trainer)
    workers = max(1, settings.num_workers)
    check_worker_split(train_set, target, workers)
    itself = bool(getattr(train_set, "ddpx_shards_itself", False))
    if not itself and replicas * workers > 1 and trainer.rank == 0:
        trainer.log.info(f"streaming data: {type(train_set).__name__} of data.target {target} does not shard itself, "
                         f"so each of {replicas} {'ranks' if replicas == trainer.world_size else 'replicas'} x {workers} workers reads the whole stream and keeps "
                         f"1 sample in {replicas * workers}; to read only its part, let it shard itself "
                         "(ddpx_shards_itself = True, ddpx.data.stream.stream_shard(): docs/config.md, Streaming "
                         "data)")
    stream = ShardedStream(train_set, replica, replicas, trainer.config.seed,
                           settings.seed_per_sample)
    loader = DataLoader(stream, batch_size=settings.batch_size, generator=generator, **loader_options)
    if not has_length(train_set):
        if settings.max_steps is None and trainer.rank == 0:
            trainer.log.info(f"streaming data: {type(train_set).__name__} of data.target {target} has no __len__ and "
                             "trainer.max_steps is null: an epoch ends only where its data does (an unbounded stream "
                             "trains until stopped)")
        return StreamLoader(loader, stream, workers)
    samples = len(train_set)
    steps = min(batches_per_rank(samples, r, replicas, workers, settings.batch_size, itself)
                for r in range(replicas))
    if steps == 0:
        raise DdpxError(f"zero steps per epoch: the stream of data.target {target} has {samples} samples, not one "
                        f"for each of {replicas} data-parallel replicas; use more data or fewer ranks")
    return CountedStreamLoader(loader, stream, workers, steps)


def _stream(trainer):
    from ddpx.data.stream import StreamLoader

    return trainer.train_loader if isinstance(trainer.train_loader, StreamLoader) else None


def _batch_sampler(trainer):
    """The training loader's resumable sampler, or None if another plugin built the loader."""
    from ddpx.data.sampler import ResumableDistributedBatchSampler

    sampler = getattr(trainer.train_loader, "batch_sampler", None)
    return sampler if isinstance(sampler, ResumableDistributedBatchSampler) else None


class SamplerPlugin:
    """The run's training-loader generator and how much of the epoch its position holds."""

    def __init__(self):
        self.synced = 0  # batches of trainer.epoch_batches already in the sampler's position
        self.generator = None  # the training loader's own generator

    @hookimpl
    def ddpx_config_defaults(self):
        return {"sampler": {"shuffle": True, "drop_last": False}}

    @hookimpl
    def ddpx_build_dataloaders(self, trainer, train_set, eval_set):
        import torch
        from torch.utils.data import DataLoader, IterableDataset

        from ddpx.data.sampler import ShardSampler
        from ddpx.data.seeded import SeededDataset

        cfg = trainer.config.section("sampler")
        settings = trainer.config.trainer
        # Data is sharded over the data-parallel replicas: the ranks of one replica (a pipeline's
        # stages, a tensor group) see the same batches.
        replica, replicas = trainer.strategy.data_parallel(trainer)
        self.generator = torch.Generator()  # reseeded every epoch in ddpx_epoch_start
        loader_options = {
            "num_workers": settings.num_workers,
            "pin_memory": trainer.device.type == "cuda",
            "persistent_workers": settings.num_workers > 0,
            "collate_fn": _collate(trainer.config.data.collate),
        }
        if isinstance(train_set, IterableDataset):
            train_loader = _stream_loader(trainer, train_set, loader_options, self.generator)
        else:
            if len(train_set) == 0:
                raise DdpxError(f"the training set of data.target {trainer.config.data.target} is empty: nothing to "
                                "train on; check data.args")
            batch_sampler = trainer.strategy.batch_sampler_class()(
                len(train_set),
                settings.batch_size,
                replica,
                replicas,
                shuffle=cfg["shuffle"],
                seed=trainer.config.seed,
                drop_last=cfg["drop_last"],
                with_epoch=True,
            )
            if len(batch_sampler) == 0:  # every epoch would end at once: exit 0 with nothing done
                raise DdpxError(f"zero steps per epoch: {len(train_set)} training samples do not fill one batch of "
                                f"trainer.batch_size={settings.batch_size} on each of {replicas} data-parallel replicas"
                                + (" with sampler.drop_last=true; set sampler.drop_last=false or lower "
                                   "trainer.batch_size" if cfg["drop_last"] else "; use more data or fewer ranks"))
            # Seeds per worker and epoch, or per sample (ddpx/rank/seeding.py): the keys carry the epoch.
            seeded = SeededDataset(train_set, trainer.config.seed, replica, settings.seed_per_sample)
            # The loader draws its workers' base seed from its own generator, not from the rank's
            # stream: a resumed run's new iterator must not shift the stream the checkpoint restored.
            train_loader = DataLoader(seeded, batch_sampler=batch_sampler, generator=self.generator,
                                      **loader_options)
        eval_loader = None
        if eval_set is not None:
            sampler = None if isinstance(eval_set, IterableDataset) else \
                ShardSampler(len(eval_set), replica, replicas)
            eval_loader = DataLoader(eval_set, batch_size=settings.eval_batch_size, sampler=sampler, **loader_options)
        return train_loader, eval_loader

    @hookimpl
    def ddpx_setup(self, trainer):
        self.synced, self.generator = 0, None

    @hookimpl(tryfirst=True)  # before anything reads len(train_loader) for this epoch
    def ddpx_epoch_start(self, trainer, epoch):
        from ddpx.rank.seeding import derive_seed

        if self.generator is not None:
            self.generator.manual_seed(derive_seed(trainer.config.seed, trainer.strategy.data_parallel(trainer)[0], epoch))
        stream = _stream(trainer)
        if stream is not None:
            stream.set_epoch(epoch)
            self.synced = 0
            return
        sampler = _batch_sampler(trainer)
        if sampler is None:
            return
        sampler.set_epoch(epoch)  # the same epoch again (a resumed run) keeps the position
        self.synced = 0

    def synced_sampler(self, trainer):
        """The training sampler, its position advanced over the batches trained since
        the last call (or None if another plugin built the loader)."""
        sampler = _batch_sampler(trainer)
        if sampler is None:
            return None
        behind = trainer.epoch_batches - self.synced
        if behind > 0:
            sampler.advance(behind)
            self.synced = trainer.epoch_batches
        return sampler

    def state_dict(self, trainer):
        stream = _stream(trainer)
        if stream is not None:  # the batches of the epoch trained: those the trainer counted
            stream.consumed += trainer.epoch_batches - self.synced
            self.synced = trainer.epoch_batches
            return {"stream": stream.state_dict()}
        sampler = self.synced_sampler(trainer)
        return None if sampler is None else sampler.state_dict()

    def load_state_dict(self, trainer, state):
        stream = _stream(trainer)
        if stream is not None and "stream" in state:
            stream.load_state_dict(state["stream"], trainer.log)
        sampler = _batch_sampler(trainer)
        if sampler is not None and "stream" not in state:
            sampler.load_state_dict(state)

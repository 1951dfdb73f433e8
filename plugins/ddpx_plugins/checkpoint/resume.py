"""Resuming (the checkpoint plugin's ``ddpx_train_start``): rank 0 picks the newest checkpoint
that loads completely, every rank reads the same file and its shard directory, then the run is
restored through ``trainer.load_state_dict``; at another world size the rest of the epoch is
re-divided, RNG streams are reseeded and the learning rate follows ``checkpoint.lr_scaling``
(the plugin's module docstring has the whole story)."""

from __future__ import annotations

from ddpx.errors import DdpxError
from ddpx.plugin.shared import ACCUMULATION_STEPS, LAST_FINITE_CHECKPOINT
from ddpx.rank.checkpoint_files import SHARDS_KEY
from ddpx.train.stopping import across_ranks

from .finite import nonfinite_weights


def resume(trainer, session) -> None:
    """Restore the newest checkpoint of ``session``'s directory, if any (every rank)."""
    path, checkpoint = _agree_on_latest(trainer, session)
    if path is None:
        return
    checkpoint, shards = _read_everywhere(trainer, path, checkpoint)
    old_world, ranks = checkpoint["world_size"], checkpoint["ranks"]
    same_world = old_world == trainer.world_size
    mine = ranks[trainer.rank] if same_world else ranks[0]
    replicated = {**checkpoint["replicated"], **_read_shards(trainer, path, shards, checkpoint.get("strategy"))}
    _load(trainer, {**replicated, **mine["plugins"]}, path)
    session.saved = (trainer.global_step, None)
    session.finite_at = trainer.global_step
    trainer.shared[LAST_FINITE_CHECKPOINT] = str(path)
    if same_world:
        from ddpx.rank.checkpoint_files import set_rng_state

        set_rng_state(mine["rng"], trainer.device)
    else:
        _resize(trainer, session, old_world)
    trainer.log.info(f"resumed from {path} (epoch {trainer.epoch}, step {trainer.global_step})")


def _agree_on_latest(trainer, session) -> tuple:
    """``(path, checkpoint)``: the checkpoint rank 0 chose (None: there is none), and on rank 0 its
    content (rank 0 read it to choose it); every rank raises when checkpoints exist and none can be
    resumed."""
    name = refusal = found = None
    if trainer.rank == 0:
        try:
            found = session.directory.load_latest(reject=nonfinite_weights)
        except DdpxError as exc:  # checkpoints exist, none can be resumed: every rank stops
            refusal = str(exc)
        name = found[0].name if found else None
    if across_ranks(trainer):
        import torch.distributed as dist

        box = [name, refusal]
        dist.broadcast_object_list(box, src=0)
        name, refusal = box
    if refusal is not None:
        raise DdpxError(refusal)
    return (None if name is None else session.directory.directory / name), (found[1] if found else None)


def _read_everywhere(trainer, path, checkpoint) -> tuple:
    """``(checkpoint, its shard directory's name or None)``, read on every rank (rank 0 has it
    already); one line on every rank when some rank cannot read it or its shard directory is missing."""
    from ddpx.rank.checkpoint_files import load_file

    error = None
    if checkpoint is None:
        try:
            checkpoint = load_file(path)  # weights_only: nothing in the file runs
        except Exception as exc:
            error = exc
    shards = checkpoint.get(SHARDS_KEY) if checkpoint is not None else None
    if shards is not None and not (path.parent / shards / ".metadata").is_file():
        checkpoint, error = None, f"its shard directory {shards} is missing"
    if across_ranks(trainer):  # every rank must have the file before anyone changes course
        import torch
        import torch.distributed as dist

        ok = torch.tensor([0 if checkpoint is None else 1], dtype=torch.int32, device=trainer.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not int(ok.item()):
            who = f"rank {trainer.rank} cannot read ({error})" if error else "another rank cannot read"
            raise DdpxError(f"{who} checkpoint {path} chosen by rank 0; put run_dir on a file system every node "
                            "sees (or set checkpoint.resume=false)")
    return checkpoint, shards


def _load(trainer, state, path) -> None:
    """``trainer.load_state_dict(state)``; another model's weights are one line."""
    try:
        trainer.load_state_dict(state)
    except RuntimeError as exc:
        if "Error(s) in loading state_dict" not in str(exc):
            raise
        detail = " ".join(str(exc).split())  # torch's lines: the model's class, missing and unexpected keys
        detail = detail if len(detail) <= 200 else detail[:197] + "..."
        raise DdpxError(f"checkpoint {path} holds another model's weights ({detail}); resume it with the model "
                        "it was saved with, or start afresh in another run_dir (or set checkpoint.resume=false)"
                        ) from None


def _resize(trainer, session, old_world) -> None:
    """Resumed at another world size: reseed, say what changed (rank 0), scale the learning rate."""
    from ddpx.rank.seeding import seed_rank

    # one stream per data-parallel replica, as at a fresh start (a pipeline's stages share theirs)
    replica, replicas = trainer.strategy.data_parallel(trainer)
    seed_rank(trainer.config.seed, replica, trainer.global_step)  # not the fresh start's stream again
    if trainer.rank == 0:
        batch, accumulation = trainer.config.trainer.batch_size, accumulation_steps(trainer)
        sampler = getattr(trainer.train_loader, "batch_sampler", None)
        redivided = f"the rest of epoch {trainer.epoch} is re-divided, " if hasattr(sampler, "epoch_batches") \
            else ""  # a stream says itself what it does
        who = "rank" if replicas == trainer.world_size else "replica"
        trainer.log.warning(
            f"resuming with {trainer.world_size} ranks from a checkpoint of {old_world}: {redivided}"
            f"the global batch is now {replicas} {who}s x "
            f"{batch} x {accumulation} accumulation steps = {replicas * batch * accumulation} "
            f"samples, RNG states are seeded from (seed, {who}, step), the learning rate is "
            + ("scaled linearly" if session.cfg["lr_scaling"] == "linear" else "unchanged")
        )
        warn_scheduler_horizon(trainer)
    if session.cfg["lr_scaling"] == "linear":
        scale_lr(trainer, trainer.world_size / old_world)


def _read_shards(trainer, path, shards, saved_strategy) -> dict:
    """The sharded entries (model, optimizer, a plugin's such as ema's) from the checkpoint's shard
    directory (every rank, any world size), those this run has; {} for a checkpoint without one. A
    checkpoint whose layout is not this strategy's (replicated, or each rank its part): one line."""
    if trainer.strategy.replicated != (shards is None):
        saved = saved_strategy or ("a sharded strategy" if shards is not None else "a replicated strategy")
        raise DdpxError(f"checkpoint {path} was saved under trainer.strategy={saved}, this run uses "
                        f"{trainer.strategy.name}: resume it with trainer.strategy={saved}, or start afresh in another "
                        "run_dir (or set checkpoint.resume=false)")
    if shards is None:
        return {}
    state = trainer.state_dict()  # this run's layout: the shards are read into it
    template = {k: state[k] for k in trainer.strategy.sharded_entries(state)}
    return trainer.strategy.read_shards(template, path.parent / shards)


def accumulation_steps(trainer) -> int:
    return trainer.shared.get(ACCUMULATION_STEPS, 1)


def run_steps(trainer):
    """Optimizer steps the whole run takes at this world size (None: unknown), counted
    from the resumed position: trainer.max_steps, else the rest of this epoch plus the
    remaining epochs."""
    max_steps = trainer.config.trainer.max_steps
    if max_steps is not None:
        return max_steps
    loader = trainer.train_loader
    sampler = getattr(loader, "batch_sampler", None)
    if sampler is None or not hasattr(sampler, "epoch_batches"):
        return None
    accumulation = accumulation_steps(trainer)
    rest = -(-len(sampler) // accumulation)
    full = -(-sampler.epoch_batches() // accumulation)
    return trainer.global_step + rest + full * (trainer.config.trainer.epochs - trainer.epoch - 1)


# Scheduler attributes that count optimizer steps to the end of the schedule.
STEP_HORIZONS = ("total_steps", "T_max", "total_iters")


def warn_scheduler_horizon(trainer) -> None:
    """After a world-size change the run takes another number of steps: a schedule
    sized in steps would end early or be overshot."""
    scheduler = trainer.scheduler
    horizon = next(((name, getattr(scheduler, name)) for name in STEP_HORIZONS
                    if isinstance(getattr(scheduler, name, None), int)), None)
    steps = run_steps(trainer)
    if horizon is None or steps is None or horizon[1] == steps:
        return
    name, value = horizon
    trainer.log.warning(f"scheduler {type(scheduler).__name__}'s {name}={value} counts optimizer steps, but at "
                        f"{trainer.world_size} ranks this run takes {steps}: the schedule "
                        + ("ends early" if value < steps else "is cut short")
                        + f"; set scheduler.args.{name}={steps} for a schedule that ends with the run")


def scale_lr(trainer, factor):
    for group in trainer.optimizer.param_groups:
        group["lr"] *= factor
        if "initial_lr" in group:
            group["initial_lr"] *= factor
    scheduler = trainer.scheduler
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
        if hasattr(scheduler, "_last_lr"):
            scheduler._last_lr = [group["lr"] for group in trainer.optimizer.param_groups]
